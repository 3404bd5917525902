//! The engine: one worker's streams and the root's calls ([`worker`]), the per-request state
//! machine that orders the guards ([`flow`]), what every event brings and answers
//! ([`context`]), the table of script calls in flight ([`calls`]), the calls that outlive a
//! request ([`outbox`]) and the worker as the adapter shares it ([`shared`]). It does no I/O:
//! the host adapter carries out what it returns.

pub(crate) mod calls;
pub mod flow;
pub(crate) mod outbox;
pub(crate) mod shared;
pub mod worker;
