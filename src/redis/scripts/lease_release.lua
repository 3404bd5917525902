-- lease_release.lua: give up the caller's lease (taken by acquire.lua), atomically, only if
-- the caller still holds it. The fence key is not touched: the next holder's token is still
-- larger than this one's.
--
-- KEYS[1]  lease key
-- KEYS[2]  cancellation marker of the owner token, optional (same hash tag as KEYS[1]): when
--          given, the caller gave up on its acquire call, which may still run later; the
--          marker is set (SET PX ARGV[2], value "1") whatever the lease's state, so that
--          acquire.lua, finding it, takes no lease. Set before the lease is looked at.
-- ARGV[1]  owner token (the one acquire.lua stored; must not be empty)
-- ARGV[2]  marker_ttl_ms: integer > 0, required iff KEYS[2] is given
--
-- Reply: integer
--    1 RELEASED   the lease held this owner: deleted
--    0 MISSING    no lease (it expired, or was never taken)
--   -1 NOT_OWNER  another owner holds it, or the key is not a string; untouched

local function bad(what) error('lease_release.lua: ' .. what, 0) end

local key = KEYS[1] or bad('KEYS[1] (lease) is missing')
local owner = ARGV[1]
if owner == nil or owner == '' then bad('ARGV[1] (owner) is missing') end

local RELEASED, MISSING, NOT_OWNER = 1, 0, -1

-- The marker, if KEYS[2] is given (piece_cancel_marker.lua, before this file).
set_cancel_marker(bad, key, 'lease')

local kind = redis.call('TYPE', key)
kind = type(kind) == 'table' and kind.ok or kind
if kind == 'none' then return MISSING end
if kind ~= 'string' or redis.call('GET', key) ~= owner then return NOT_OWNER end
redis.call('DEL', key)
return RELEASED
