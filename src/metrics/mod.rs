//! The one home of vLLM metric knowledge: family names with their older spellings
//! ([`names`]), counter increases, histogram quantiles and label-set combination
//! ([`maths`]), and [`MetricIndex`], a recording's scraped points by engine with the family
//! lookups. `report`, `diff`, the timeline, `top`, the agent and the tests all read engine
//! metrics through here; scraping itself lives in `vllm::metrics`.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use enginescope::metrics::{names, MetricIndex};
//! let rec = enginescope::record::read_recording("run.esrec".as_ref())?;
//! let ix = MetricIndex::new(&rec);
//! for e in ix.engines() {
//!     let gen = ix.rate(e, &names::GENERATION_TOKENS, 0, u64::MAX);
//!     let ttft = ix.histogram(e, &names::TTFT, 0, u64::MAX).map(|h| h.quantiles_ms());
//!     println!("{e}: {gen:?} tok/s, TTFT {ttft:?}");
//! }
//! # Ok(()) }
//! ```

pub mod index;
pub mod maths;
pub mod names;

pub use index::{Increase, MetricIndex, Split};
pub use maths::{HistogramDelta, LatencyQuantiles};
pub use names::{Family, GaugeAgg};
