//! The Lua scripts, one per atomic operation, each `.lua` next to the Rust module that owns
//! its contract: the arguments it is called with and what its reply means.
//!
//! * [`acquire`]: `acquire.lua` (rate limits, the idempotency record, the lease of one slot);
//! * [`record`]: `complete.lua` and `release.lua` (a request's record settled);
//! * [`lease`]: `lease_release.lua` and `lease_extend.lua`;
//! * [`slot`]: `slot_release.lua` and `slot_extend.lua` (concurrency slots);
//! * [`charge`]: `charge.lua` (a response's real cost);
//! * [`batch`]: `batch.lua` (`batch_head.lua`, each batched script as a local function,
//!   `batch_tail.lua`), several acquires or settlements in one call.

pub mod acquire;
pub mod batch;
pub mod charge;
pub mod lease;
pub mod record;
pub mod slot;

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
    /// Gives a concurrency slot back.
    SlotRelease,
    /// Extends a concurrency slot.
    SlotExtend,
    /// Corrects counters by a response's charge.
    Charge,
}

impl ScriptId {
    /// This script as a sub-call of `batch.lua`, with its number there (see
    /// `batch_head.lua`); `None` for a script it does not run.
    pub fn batched(self) -> Option<Batched> {
        let index = match self {
            ScriptId::Acquire => 1,
            ScriptId::Complete => 2,
            ScriptId::Release => 3,
            ScriptId::LeaseRelease => 4,
            ScriptId::SlotRelease => 5,
            ScriptId::Charge => 6,
            ScriptId::LeaseExtend | ScriptId::SlotExtend | ScriptId::Batch => return None,
        };
        Some(Batched(index))
    }
}

/// A script `batch.lua` runs, as its sub-call number there. Only [`ScriptId::batched`] makes
/// one, so a batch cannot carry a script it does not run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batched(u64);

impl Batched {
    /// Its number in `batch.lua` (a sub-call's first word).
    pub fn index(self) -> u64 {
        self.0
    }
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
    pub slot_release: Script,
    pub slot_extend: Script,
    pub charge: Script,
}

impl Scripts {
    pub fn load() -> Scripts {
        Scripts {
            acquire: Script::new("acquire", include_str!("acquire.lua")),
            complete: Script::new("complete", include_str!("complete.lua")),
            release: Script::new("release", include_str!("release.lua")),
            lease_release: Script::new("lease_release", include_str!("lease_release.lua")),
            lease_extend: Script::new("lease_extend", include_str!("lease_extend.lua")),
            slot_release: Script::new("slot_release", include_str!("slot_release.lua")),
            slot_extend: Script::new("slot_extend", include_str!("slot_extend.lua")),
            charge: Script::new("charge", include_str!("charge.lua")),
            batch: Script::new(
                "batch",
                concat!(
                    include_str!("batch_head.lua"),
                    "local function acquire_one(KEYS, ARGV)\n",
                    include_str!("acquire.lua"),
                    "end\nlocal function complete_one(KEYS, ARGV)\n",
                    include_str!("complete.lua"),
                    "end\nlocal function release_one(KEYS, ARGV)\n",
                    include_str!("release.lua"),
                    "end\nlocal function lease_release_one(KEYS, ARGV)\n",
                    include_str!("lease_release.lua"),
                    "end\nlocal function slot_release_one(KEYS, ARGV)\n",
                    include_str!("slot_release.lua"),
                    "end\nlocal function charge_one(KEYS, ARGV)\n",
                    include_str!("charge.lua"),
                    "end\n",
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
            ScriptId::SlotRelease => &self.slot_release,
            ScriptId::SlotExtend => &self.slot_extend,
            ScriptId::Charge => &self.charge,
        }
    }
}
