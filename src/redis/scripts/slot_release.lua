-- slot_release.lua: give back the caller's concurrency slot (taken by acquire.lua),
-- atomically; only the caller's own slot (its member) is removed, so a slot is given back
-- once however often this runs.
--
-- KEYS[1]  concurrency key: a sorted set of the requests holding a slot
-- KEYS[2]  cancellation marker of the owner token, optional (same hash tag as KEYS[1]): when
--          given, the caller gave up on its acquire call, which may still run later; the
--          marker is set (SET PX ARGV[2], value "1") before the slot is looked at, so that
--          acquire.lua, finding it, takes no slot.
-- ARGV[1]  member: the nonce acquire.lua stored (must not be empty)
-- ARGV[2]  marker_ttl_ms: integer > 0, required iff KEYS[2] is given
--
-- Reply: integer
--    1 RELEASED  the member was there: removed (also one whose slot had expired, not yet swept)
--    0 MISSING   no such member (swept or gone with its key after it expired, released, or
--                never taken); nothing written but the marker

local function bad(what) error('slot_release.lua: ' .. what, 0) end

local key = KEYS[1] or bad('KEYS[1] (concurrency key) is missing')
local member = ARGV[1]
if member == nil or member == '' then bad('ARGV[1] (member) is missing') end

-- The marker, if KEYS[2] is given (piece_cancel_marker.lua, before this file).
set_cancel_marker(bad, key, 'concurrency key')

local kind = redis.call('TYPE', key)
kind = type(kind) == 'table' and kind.ok or kind
if kind ~= 'zset' then return 0 end
return redis.call('ZREM', key, member)
