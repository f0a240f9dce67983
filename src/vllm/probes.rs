//! vLLM's functions worth timing: the default probes of `--vllm` and the ones that say what a
//! process is doing, and how a probed function's qualified name is matched against them.

/// Functions probed by default in vLLM processes (`record --vllm`): the calls that proved the
/// router-replay fix, most important first (earlier probes win debug registers). Names that
/// match nothing cost nothing.
pub const VLLM_DEFAULT_PROBES: &[&str] = &[
    "MessageQueue.enqueue",
    "MessageQueue.dequeue",
    "Worker.execute_model",
    "_evict_to_fit",
    "EngineCore.step",
    "EngineCore.step_with_batch_queue",
    "BlockObjectStore.put",
    "AuxOutputStore.put",
];

/// Of the default probes, the ones that say what a vLLM process is doing, for `top`'s line per
/// process: an engine core's step and a worker's model run (what the MessageQueue calls inside
/// them add up to).
pub const VLLM_HEADLINE_PROBES: &[&str] = &[
    "EngineCore.step",
    "EngineCore.step_with_batch_queue",
    "Worker.execute_model",
];

/// Whether a qualified name is `name` or ends with it as a dotted suffix
/// (`mod.<locals>.MessageQueue.enqueue` names `MessageQueue.enqueue`).
pub fn names(qualname: &str, name: &str) -> bool {
    qualname == name
        || qualname
            .strip_suffix(name)
            .is_some_and(|head| head.ends_with('.'))
}

/// Whether a probed function is one of [`VLLM_HEADLINE_PROBES`].
pub fn is_headline(function: &str) -> bool {
    VLLM_HEADLINE_PROBES.iter().any(|h| names(function, h))
}
