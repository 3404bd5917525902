//! The Lua scripts, one per atomic operation, each `.lua` next to the Rust module that owns
//! its contract: the arguments it is called with and what its reply means.
//!
//! * [`acquire`]: `acquire.lua` (rate limits, the idempotency record, the lease of one slot);
//! * [`record`]: `complete.lua` and `release.lua` (a request's record settled);
//! * [`lease`]: `lease_release.lua` and `lease_extend.lua`;
//! * [`batch`]: `batch.lua` (`batch_head.lua` + `acquire.lua` + `batch_tail.lua`), several
//!   acquires in one call.

pub mod acquire;
pub mod batch;
pub mod lease;
pub mod record;

use crate::redis::Script;

/// Which script a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScriptId {
    /// Rate limits and the idempotency acquire of one hash slot.
    Acquire,
    /// `PROCESSING` -> `COMPLETED`, only by the owner.
    Complete,
    /// Deletes a `PROCESSING` record, only by the owner.
    Release,
    /// Deletes a lease, only by its owner.
    LeaseRelease,
    /// Extends a lease, only by its owner.
    LeaseExtend,
    /// Several acquires in one call (callout coalescing).
    Batch,
}

/// The scripts the filter runs, loaded once per VM.
#[derive(Debug)]
pub struct Scripts {
    pub acquire: Script,
    pub complete: Script,
    pub release: Script,
    pub lease_release: Script,
    pub lease_extend: Script,
    pub batch: Script,
}

impl Scripts {
    pub fn load() -> Scripts {
        Scripts {
            acquire: Script::new("acquire", include_str!("acquire.lua")),
            complete: Script::new("complete", include_str!("complete.lua")),
            release: Script::new("release", include_str!("release.lua")),
            lease_release: Script::new("lease_release", include_str!("lease_release.lua")),
            lease_extend: Script::new("lease_extend", include_str!("lease_extend.lua")),
            batch: Script::new(
                "batch",
                concat!(
                    include_str!("batch_head.lua"),
                    include_str!("acquire.lua"),
                    include_str!("batch_tail.lua")
                ),
            ),
        }
    }

    pub fn get(&self, id: ScriptId) -> &Script {
        match id {
            ScriptId::Acquire => &self.acquire,
            ScriptId::Complete => &self.complete,
            ScriptId::Release => &self.release,
            ScriptId::LeaseRelease => &self.lease_release,
            ScriptId::LeaseExtend => &self.lease_extend,
            ScriptId::Batch => &self.batch,
        }
    }
}
