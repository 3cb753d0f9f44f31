//! The names the agent writes for the ABI's enums (JSON lines, OTLP attributes, the terminal),
//! on the enums themselves so every output spells them the same way.

use crate::{
    api::{Direction, MemKind},
    cupti::{CuptiState, NvtxState},
    event::EventKind,
};

impl EventKind {
    /// All kinds, in ABI order.
    pub const ALL: [EventKind; 7] = [
        EventKind::Launch,
        EventKind::Call,
        EventKind::Ioctl,
        EventKind::ProcessExit,
        EventKind::Name,
        EventKind::Gpu,
        EventKind::GpuName,
    ];

    /// The kind's name in drop counts (`dropped_by_kind`).
    pub const fn name(self) -> &'static str {
        match self {
            EventKind::Launch => "launch",
            EventKind::Call => "call",
            EventKind::Ioctl => "ioctl",
            EventKind::ProcessExit => "process_exit",
            EventKind::Name => "name",
            EventKind::Gpu => "gpu",
            EventKind::GpuName => "gpu_name",
        }
    }
}

impl Direction {
    /// Directions in the fixed order of tables and JSON (`None` is reported as unknown).
    pub const REPORTED: [Direction; 4] = [
        Direction::CpuToGpu,
        Direction::GpuToCpu,
        Direction::GpuToGpu,
        Direction::Unknown,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Direction::CpuToGpu => "cpu_to_gpu",
            Direction::GpuToCpu => "gpu_to_cpu",
            Direction::GpuToGpu => "gpu_to_gpu",
            Direction::Unknown | Direction::None => "unknown",
        }
    }

    /// Index into [`Self::REPORTED`].
    pub const fn index(self) -> usize {
        match self {
            Direction::CpuToGpu => 0,
            Direction::GpuToCpu => 1,
            Direction::GpuToGpu => 2,
            Direction::Unknown | Direction::None => 3,
        }
    }
}

impl MemKind {
    pub const fn name(self) -> &'static str {
        match self {
            MemKind::Device | MemKind::None => "device",
            MemKind::Managed => "managed",
            MemKind::Host => "host",
        }
    }
}

impl CuptiState {
    /// The state's name; `None` (no status record yet) is `unknown`.
    pub const fn name_of(s: Option<CuptiState>) -> &'static str {
        match s {
            Some(CuptiState::Active) => "active",
            Some(CuptiState::Busy) => "busy",
            Some(CuptiState::NoCupti) => "no_cupti",
            Some(CuptiState::Failed) => "failed",
            Some(CuptiState::Idle) => "idle",
            Some(CuptiState::Starting) => "starting",
            None => "unknown",
        }
    }

    /// What the user should know about a state.
    pub const fn message_of(s: Option<CuptiState>) -> &'static str {
        match s {
            Some(CuptiState::Active) => "CUPTI active: GPU start/end times are joined to launches",
            Some(CuptiState::Busy) => {
                "CUPTI is in use by another profiler (nsys, ncu, compute-sanitizer or an in-process profiler): observed with uprobes only"
            }
            Some(CuptiState::NoCupti) => {
                "the injection library found no libcupti (set GPU_OBSERVER_CUPTI_PATH): observed with uprobes only"
            }
            Some(CuptiState::Failed) => "CUPTI could not be set up: observed with uprobes only",
            Some(CuptiState::Idle) => "CUPTI collection stopped",
            Some(CuptiState::Starting) => "CUPTI collection starting",
            None => "unknown CUPTI state",
        }
    }
}

impl NvtxState {
    /// The state's name; `None` (no status record yet) is `unknown`.
    pub const fn name_of(s: Option<NvtxState>) -> &'static str {
        match s {
            Some(NvtxState::NotLoaded) => "not_loaded",
            Some(NvtxState::Active) => "active",
            Some(NvtxState::Failed) => "failed",
            None => "unknown",
        }
    }

    /// What the user should know about a state.
    pub const fn message_of(s: Option<NvtxState>) -> &'static str {
        match s {
            Some(NvtxState::NotLoaded) => {
                "no NVTX call reached gpu-observer's NVTX tool (the program made none yet, or NVTX_INJECTION64_PATH names another tool)"
            }
            Some(NvtxState::Active) => "NVTX ranges are recorded through CUPTI",
            Some(NvtxState::Failed) => "CUPTI could not be the NVTX tool: NVTX ranges are not recorded",
            None => "NVTX ranges need `gpu-observer run` (the injection library is the NVTX tool)",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_event_kind_has_its_abi_value_and_a_distinct_name() {
        for (i, k) in EventKind::ALL.iter().enumerate() {
            assert_eq!(*k as u32, i as u32 + 1);
            assert_eq!(EventKind::from_u32(*k as u32), Some(*k));
        }
        assert_eq!(EventKind::ALL.len() as u32, EventKind::COUNT - 1);
        let mut names: [&str; 7] = EventKind::ALL.map(EventKind::name);
        names.sort_unstable();
        assert!(names.windows(2).all(|w| w[0] != w[1]));
    }

    #[test]
    fn directions_index_their_reported_order() {
        for (i, d) in Direction::REPORTED.iter().enumerate() {
            assert_eq!(d.index(), i);
        }
        assert_eq!(Direction::None.name(), "unknown");
        assert_eq!(Direction::CpuToGpu.name(), "cpu_to_gpu");
    }

    #[test]
    fn cupti_states_are_named_and_none_is_unknown() {
        assert_eq!(CuptiState::name_of(Some(CuptiState::NoCupti)), "no_cupti");
        assert_eq!(CuptiState::name_of(None), "unknown");
        assert!(CuptiState::message_of(Some(CuptiState::Busy)).contains("another profiler"));
    }
}
