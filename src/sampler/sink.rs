//! Where paired events go. The pairing state machines ([`super::Pipeline`]'s off-CPU intervals,
//! GIL waits and GC pauses; [`super::probes::Probes`]' entry/return pairs) write through
//! [`Sink`], so they are unit-tested with a `Vec<Event>` and run with a `RecordingWriter`.

use crate::record::{
    FunctionCall, GcMethodInfo, GcPause, GilWait, OffCpu, ProbeInfo, ProbeWatch, RecordingWriter,
    Sample, Wake,
};

pub trait Sink {
    fn sample(&mut self, s: &Sample) -> anyhow::Result<()>;
    fn offcpu(&mut self, o: &OffCpu) -> anyhow::Result<()>;
    fn gil_wait(&mut self, w: &GilWait) -> anyhow::Result<()>;
    fn wake(&mut self, w: &Wake) -> anyhow::Result<()>;
    fn gc_pause(&mut self, g: &GcPause) -> anyhow::Result<()>;
    fn probe(&mut self, p: &ProbeInfo) -> anyhow::Result<()>;
    fn call(&mut self, c: &FunctionCall) -> anyhow::Result<()>;
    fn probe_watch(&mut self, w: &ProbeWatch) -> anyhow::Result<()>;
    fn gc_method(&mut self, g: &GcMethodInfo) -> anyhow::Result<()>;
}

impl Sink for RecordingWriter {
    fn sample(&mut self, s: &Sample) -> anyhow::Result<()> {
        RecordingWriter::sample(self, s)
    }
    fn offcpu(&mut self, o: &OffCpu) -> anyhow::Result<()> {
        RecordingWriter::offcpu(self, o)
    }
    fn gil_wait(&mut self, w: &GilWait) -> anyhow::Result<()> {
        RecordingWriter::gil_wait(self, w)
    }
    fn wake(&mut self, w: &Wake) -> anyhow::Result<()> {
        RecordingWriter::wake(self, w)
    }
    fn gc_pause(&mut self, g: &GcPause) -> anyhow::Result<()> {
        RecordingWriter::gc_pause(self, g)
    }
    fn probe(&mut self, p: &ProbeInfo) -> anyhow::Result<()> {
        RecordingWriter::probe(self, p)
    }
    fn call(&mut self, c: &FunctionCall) -> anyhow::Result<()> {
        RecordingWriter::call(self, c)
    }
    fn probe_watch(&mut self, w: &ProbeWatch) -> anyhow::Result<()> {
        RecordingWriter::probe_watch(self, w)
    }
    fn gc_method(&mut self, g: &GcMethodInfo) -> anyhow::Result<()> {
        RecordingWriter::gc_method(self, g)
    }
}

/// One event written to a [`Sink`], as kept by the in-memory sink.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Sample(Sample),
    OffCpu(OffCpu),
    GilWait(GilWait),
    Wake(Wake),
    GcPause(GcPause),
    Probe(ProbeInfo),
    Call(FunctionCall),
    ProbeWatch(ProbeWatch),
    GcMethod(GcMethodInfo),
}

/// The in-memory sink (tests).
impl Sink for Vec<Event> {
    fn sample(&mut self, s: &Sample) -> anyhow::Result<()> {
        self.push(Event::Sample(*s));
        Ok(())
    }
    fn offcpu(&mut self, o: &OffCpu) -> anyhow::Result<()> {
        self.push(Event::OffCpu(*o));
        Ok(())
    }
    fn gil_wait(&mut self, w: &GilWait) -> anyhow::Result<()> {
        self.push(Event::GilWait(*w));
        Ok(())
    }
    fn wake(&mut self, w: &Wake) -> anyhow::Result<()> {
        self.push(Event::Wake(*w));
        Ok(())
    }
    fn gc_pause(&mut self, g: &GcPause) -> anyhow::Result<()> {
        self.push(Event::GcPause(*g));
        Ok(())
    }
    fn probe(&mut self, p: &ProbeInfo) -> anyhow::Result<()> {
        self.push(Event::Probe(p.clone()));
        Ok(())
    }
    fn call(&mut self, c: &FunctionCall) -> anyhow::Result<()> {
        self.push(Event::Call(*c));
        Ok(())
    }
    fn probe_watch(&mut self, w: &ProbeWatch) -> anyhow::Result<()> {
        self.push(Event::ProbeWatch(*w));
        Ok(())
    }
    fn gc_method(&mut self, g: &GcMethodInfo) -> anyhow::Result<()> {
        self.push(Event::GcMethod(g.clone()));
        Ok(())
    }
}
