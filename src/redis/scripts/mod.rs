//! The Lua scripts, one per atomic operation, each `.lua` next to the Rust module that owns
//! its contract: the arguments it is called with and what its reply means.
//!
//! * [`acquire`]: `acquire.lua` (rate limits, the idempotency record, the lease of one slot);
//!   [`peek`] is the same file read-only, for the operator's tool;
//! * [`record`]: `complete.lua` and `release.lua` (a request's record settled);
//! * [`lease`]: `lease_release.lua` and `lease_extend.lua`;
//! * [`slot`]: `slot_release.lua` and `slot_extend.lua` (concurrency slots);
//! * [`charge`]: `charge.lua` (a response's real cost);
//! * [`batch`]: `batch.lua` (`batch_head.lua`, each batched script as a local function,
//!   `batch_tail.lua`), several acquires or settlements in one call.
//!
//! Every script as the filter sends it is its body between `tagged_head.lua` and
//! `tagged_tail.lua`: the call's tag is its first argument, and its reply carries the tag back
//! ([`crate::redis::tag`]). Inside `batch.lua` each sub-call's function is the body alone (the
//! batch is one call, with one tag).
//!
//! Code two scripts share is a piece of its own, `piece_*.lua`, a `local function` that
//! [`Scripts::load`] puts before each script that calls it (so inside `batch.lua` each
//! sub-call's function defines it again):
//!
//! * `piece_window_roll.lua`: `window_roll`, a sliding-window counter rolled over to the
//!   current window (`acquire.lua`, `charge.lua`);
//! * `piece_calendar.lua`: `calendar_zone` and `calendar_period`, the calendar day, week or
//!   month that holds Redis TIME in a limit's zone (`acquire.lua`, `charge.lua`);
//! * `piece_cancel_marker.lua`: `set_cancel_marker`, the cancellation marker a release sets
//!   (`release.lua`, `lease_release.lua`, `slot_release.lua`).
//!
//! A script's text is this module's to assemble: whoever runs a script outside the filter
//! (tests/harness/scripts.py, the benchmarks) reads its recipe here, in the macros below and
//! [`Scripts::load`]. So a script's text stays in the forms that reader knows: string
//! literals, `include_str!`, `concat!`, and macros `() => { <text> };` of this file.

pub(crate) mod acquire;
pub(crate) mod batch;
pub(crate) mod charge;
pub(crate) mod lease;
pub(crate) mod record;
pub(crate) mod slot;

use crate::redis::Script;

// Each script that includes a piece, as it runs: its pieces, then its own file. Each is used
// twice, alone and as a sub-call's body in batch.lua. acquire.lua starts with the value of
// its PEEK local: false for the filter's acquire, true for the read-only `peek` ([`peek`]).
macro_rules! acquire_lua {
    () => {
        concat!(
            "local PEEK = false\n",
            include_str!("piece_window_roll.lua"),
            include_str!("piece_calendar.lua"),
            include_str!("acquire.lua")
        )
    };
}
#[cfg_attr(target_os = "wasi", allow(unused_macros))]
macro_rules! peek_lua {
    () => {
        concat!(
            "local PEEK = true\n",
            include_str!("piece_window_roll.lua"),
            include_str!("piece_calendar.lua"),
            include_str!("acquire.lua")
        )
    };
}
macro_rules! release_lua {
    () => {
        concat!(
            include_str!("piece_cancel_marker.lua"),
            include_str!("release.lua")
        )
    };
}
macro_rules! lease_release_lua {
    () => {
        concat!(
            include_str!("piece_cancel_marker.lua"),
            include_str!("lease_release.lua")
        )
    };
}
macro_rules! slot_release_lua {
    () => {
        concat!(
            include_str!("piece_cancel_marker.lua"),
            include_str!("slot_release.lua")
        )
    };
}
macro_rules! charge_lua {
    () => {
        concat!(
            include_str!("piece_window_roll.lua"),
            include_str!("piece_calendar.lua"),
            include_str!("charge.lua")
        )
    };
}

/// Which script a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScriptId {
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
    pub(crate) fn batched(self) -> Option<Batched> {
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
pub(crate) struct Batched(u64);

impl Batched {
    /// Its number in `batch.lua` (a sub-call's first word).
    pub(crate) fn index(self) -> u64 {
        self.0
    }
}

/// The scripts the filter runs, loaded once per VM.
#[derive(Debug)]
pub struct Scripts {
    pub(crate) acquire: Script,
    pub(crate) complete: Script,
    pub(crate) release: Script,
    pub(crate) lease_release: Script,
    pub(crate) lease_extend: Script,
    pub(crate) batch: Script,
    pub(crate) slot_release: Script,
    pub(crate) slot_extend: Script,
    pub(crate) charge: Script,
}

impl Scripts {
    pub(crate) fn load() -> Scripts {
        Scripts {
            acquire: Script::new(
                "acquire",
                concat!(
                    include_str!("tagged_head.lua"),
                    acquire_lua!(),
                    include_str!("tagged_tail.lua")
                ),
            ),
            complete: Script::new(
                "complete",
                concat!(
                    include_str!("tagged_head.lua"),
                    include_str!("complete.lua"),
                    include_str!("tagged_tail.lua")
                ),
            ),
            release: Script::new(
                "release",
                concat!(
                    include_str!("tagged_head.lua"),
                    release_lua!(),
                    include_str!("tagged_tail.lua")
                ),
            ),
            lease_release: Script::new(
                "lease_release",
                concat!(
                    include_str!("tagged_head.lua"),
                    lease_release_lua!(),
                    include_str!("tagged_tail.lua")
                ),
            ),
            lease_extend: Script::new(
                "lease_extend",
                concat!(
                    include_str!("tagged_head.lua"),
                    include_str!("lease_extend.lua"),
                    include_str!("tagged_tail.lua")
                ),
            ),
            slot_release: Script::new(
                "slot_release",
                concat!(
                    include_str!("tagged_head.lua"),
                    slot_release_lua!(),
                    include_str!("tagged_tail.lua")
                ),
            ),
            slot_extend: Script::new(
                "slot_extend",
                concat!(
                    include_str!("tagged_head.lua"),
                    include_str!("slot_extend.lua"),
                    include_str!("tagged_tail.lua")
                ),
            ),
            charge: Script::new(
                "charge",
                concat!(
                    include_str!("tagged_head.lua"),
                    charge_lua!(),
                    include_str!("tagged_tail.lua")
                ),
            ),
            batch: Script::new(
                "batch",
                concat!(
                    include_str!("tagged_head.lua"),
                    include_str!("batch_head.lua"),
                    "local function acquire_one(KEYS, ARGV)\n",
                    acquire_lua!(),
                    "end\nlocal function complete_one(KEYS, ARGV)\n",
                    include_str!("complete.lua"),
                    "end\nlocal function release_one(KEYS, ARGV)\n",
                    release_lua!(),
                    "end\nlocal function lease_release_one(KEYS, ARGV)\n",
                    lease_release_lua!(),
                    "end\nlocal function slot_release_one(KEYS, ARGV)\n",
                    slot_release_lua!(),
                    "end\nlocal function charge_one(KEYS, ARGV)\n",
                    charge_lua!(),
                    "end\n",
                    include_str!("batch_tail.lua"),
                    include_str!("tagged_tail.lua")
                ),
            ),
        }
    }

    pub(crate) fn get(&self, id: ScriptId) -> &Script {
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

/// `acquire.lua` read-only (its `PEEK` local true): the rate limits' answer a request of the
/// given cost would get now, each limit's state before it, and nothing written. The filter
/// never runs it; the operator's tool does (`cg-admin limits`), with `EVAL`.
#[cfg_attr(target_os = "wasi", allow(dead_code))]
pub(crate) fn peek() -> Script {
    Script::new(
        "peek",
        concat!(
            include_str!("tagged_head.lua"),
            peek_lua!(),
            include_str!("tagged_tail.lua")
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const ALL: [ScriptId; 9] = [
        ScriptId::Acquire,
        ScriptId::Complete,
        ScriptId::Release,
        ScriptId::LeaseRelease,
        ScriptId::LeaseExtend,
        ScriptId::Batch,
        ScriptId::SlotRelease,
        ScriptId::SlotExtend,
        ScriptId::Charge,
    ];

    /// A piece two scripts share: its file, lines of the code it holds that no other file may
    /// write out (each was once written out in every script that now includes the piece), and
    /// those scripts.
    struct Piece {
        file: &'static str,
        text: &'static str,
        lines: &'static [&'static str],
        scripts: &'static [ScriptId],
    }

    const PIECES: [Piece; 3] = [
        Piece {
            file: "piece_window_roll.lua",
            text: include_str!("piece_window_roll.lua"),
            lines: &[
                "local function window_roll(",
                "redis.call('HMGET', key, 'w', 'c', 'p')",
                "prev, cur = cur, 0",
                "prev, cur = 0, 0",
            ],
            scripts: &[ScriptId::Acquire, ScriptId::Charge],
        },
        Piece {
            file: "piece_calendar.lua",
            text: include_str!("piece_calendar.lua"),
            lines: &[
                "local function calendar_zone(",
                "local function calendar_period(",
                "local function days_from_civil(",
                "local function first_reading(",
            ],
            scripts: &[ScriptId::Acquire, ScriptId::Charge],
        },
        Piece {
            file: "piece_cancel_marker.lua",
            text: include_str!("piece_cancel_marker.lua"),
            lines: &[
                "local function set_cancel_marker(",
                "bad('ARGV[2] (marker_ttl_ms) must be an integer >= 1, got '",
                "redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])",
            ],
            scripts: &[
                ScriptId::Release,
                ScriptId::LeaseRelease,
                ScriptId::SlotRelease,
            ],
        },
    ];

    /// How often `piece` is in the script `id` as loaded: once in each script that includes
    /// it, in batch.lua once per batched script that does, nowhere else.
    fn expected(piece: &Piece, id: ScriptId) -> usize {
        if id == ScriptId::Batch {
            piece
                .scripts
                .iter()
                .filter(|s| s.batched().is_some())
                .count()
        } else {
            usize::from(piece.scripts.contains(&id))
        }
    }

    #[test]
    fn each_script_holds_its_pieces_once_and_their_code_nowhere_else() {
        let scripts = Scripts::load();
        for piece in &PIECES {
            for id in ALL {
                let script = scripts.get(id);
                let want = expected(piece, id);
                assert_eq!(
                    script.source.matches(piece.text).count(),
                    want,
                    "{} in {}",
                    piece.file,
                    script.name
                );
                // No script writes the piece's code out beside it.
                for line in piece.lines {
                    assert_eq!(
                        script.source.matches(line).count(),
                        want,
                        "{line:?} in {}",
                        script.name
                    );
                }
            }
        }
    }

    const HEAD: &str = include_str!("tagged_head.lua");
    const TAIL: &str = include_str!("tagged_tail.lua");

    /// A script's body: its text without the tag's wrapper.
    fn body(script: &Script) -> &str {
        script
            .source
            .strip_prefix(HEAD)
            .and_then(|s| s.strip_suffix(TAIL))
            .unwrap_or_else(|| panic!("{} is not between the tag's head and tail", script.name))
    }

    #[test]
    fn every_script_is_its_body_between_the_tags_head_and_tail_once() {
        let scripts = Scripts::load();
        let peek = peek();
        for script in ALL.into_iter().map(|id| scripts.get(id)).chain([&peek]) {
            let body = body(script);
            assert!(
                !body.contains(HEAD) && !body.contains(TAIL),
                "{}",
                script.name
            );
            assert!(!body.contains("local TAG ="), "{}", script.name);
        }
        // The wrapper's text: a function around the body, the tag out of ARGV before it.
        assert!(HEAD.ends_with("local TAG = table.remove(ARGV, 1) or error('a script call without its tag (ARGV[1])', 0)\nlocal function body(KEYS, ARGV)\n"));
        assert!(TAIL.starts_with("end\nlocal reply = body(KEYS, ARGV)\n"));
    }

    #[test]
    fn peek_is_acquire_but_for_its_first_line() {
        let (acquire, peek) = (Scripts::load().acquire, peek());
        let (acquire, peek_body) = (body(&acquire), body(&peek));
        assert_eq!(
            acquire.split_once('\n'),
            Some((
                "local PEEK = false",
                &peek_body["local PEEK = true\n".len()..]
            ))
        );
        assert!(peek_body.starts_with("local PEEK = true\n"));
        assert_ne!(Scripts::load().acquire.sha1, peek.sha1);
    }

    #[test]
    fn batch_runs_each_batched_script_as_it_runs_alone() {
        let scripts = Scripts::load();
        for id in ALL.into_iter().filter(|id| id.batched().is_some()) {
            let script = scripts.get(id);
            let body = format!(
                "local function {}_one(KEYS, ARGV)\n{}end\n",
                script.name,
                body(script)
            );
            assert_eq!(
                scripts.batch.source.matches(&body).count(),
                1,
                "{}",
                script.name
            );
        }
    }

    /// No `.lua` file next to this module but a piece itself writes out a piece's code, and
    /// every `piece_*.lua` file is one of [`PIECES`]. Reads the directory: not under Wasm.
    #[cfg(not(target_arch = "wasm32"))]
    #[test]
    fn no_lua_file_but_the_piece_writes_its_code_out() {
        let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file!());
        let dir = here.parent().expect("this module's directory");
        let mut seen = Vec::new();
        for entry in std::fs::read_dir(dir).expect("this module's directory") {
            let path = entry.expect("a directory entry").path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if !name.ends_with(".lua") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("a .lua file");
            for piece in &PIECES {
                if name == piece.file {
                    assert_eq!(text, piece.text, "{name} as included");
                    continue;
                }
                for line in piece.lines {
                    assert!(!text.contains(line), "{name} writes {line:?} out");
                }
            }
            if name.starts_with("piece_") {
                assert!(
                    PIECES.iter().any(|p| p.file == name),
                    "{name} is not in PIECES"
                );
            }
            seen.push(name);
        }
        for piece in &PIECES {
            assert!(seen.contains(&piece.file.to_string()), "{}", piece.file);
        }
        assert!(seen.len() > PIECES.len(), "only {seen:?}");
    }
}
