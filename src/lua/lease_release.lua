-- lease_release.lua: give up the caller's lease (taken by acquire.lua), atomically, only if
-- the caller still holds it. The fence key is not touched: the next holder's token is still
-- larger than this one's.
--
-- KEYS[1]  lease key
-- ARGV[1]  owner token (the one acquire.lua stored; must not be empty)
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

local kind = redis.call('TYPE', key)
kind = type(kind) == 'table' and kind.ok or kind
if kind == 'none' then return MISSING end
if kind ~= 'string' or redis.call('GET', key) ~= owner then return NOT_OWNER end
redis.call('DEL', key)
return RELEASED
