-- batch.lua: several acquire.lua calls in one script call (callout coalescing).
--
-- Built by concatenation: this head, then acquire.lua, then batch_tail.lua. acquire.lua's
-- body becomes the function acquire_one(KEYS, ARGV), so each sub-call runs exactly as it would
-- alone, one after the other, inside one atomic script.
--
-- KEYS       the keys of every sub-call, in order
-- ARGV[1]    count: number of sub-calls
-- then per sub-call: nkeys, nargs, then its nargs arguments (acquire.lua's ARGV)
--
-- Reply: flat array (webdis cannot carry nested arrays): per sub-call, its reply length then
-- its reply values; -1 instead of a length when that sub-call raised an error (then
-- followed by one value, the error text). Keys of different sub-calls may be in different
-- hash slots: Redis Cluster refuses such a call (CROSSSLOT) before running any of it. A worker
-- first sends an empty batch (count 0) whose two keys are in different slots, and mixes slots
-- only when that probe returns an (empty) array.

local function acquire_one(KEYS, ARGV)
