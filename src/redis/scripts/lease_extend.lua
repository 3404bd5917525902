-- lease_extend.lua: extend the caller's lease (taken by acquire.lua) to lease_ttl_ms from
-- now, atomically, only if the caller still holds it. A lease that expired is not revived:
-- the caller has to acquire again and gets a new fencing token.
--
-- KEYS[1]  lease key
-- ARGV[1]  owner token (the one acquire.lua stored; must not be empty)
-- ARGV[2]  lease_ttl_ms: integer > 0, the lease's new PTTL (may be shorter than the current)
--
-- Reply: integer
--    1 EXTENDED   the lease held this owner: PEXPIRE lease_ttl_ms
--    0 MISSING    no lease (it expired, or was never taken); nothing written
--   -1 NOT_OWNER  another owner holds it, or the key is not a string; untouched
--
-- Arguments are validated before anything is read or written; a bad one is a script error.

local function bad(what) error('lease_extend.lua: ' .. what, 0) end

local key = KEYS[1] or bad('KEYS[1] (lease) is missing')
local owner = ARGV[1]
if owner == nil or owner == '' then bad('ARGV[1] (owner) is missing') end
local ttl = tonumber(ARGV[2])
if ttl == nil or ttl ~= math.floor(ttl) or ttl < 1 or ttl == math.huge then
  bad('ARGV[2] (lease_ttl_ms) must be an integer >= 1, got ' .. tostring(ARGV[2]))
end

local EXTENDED, MISSING, NOT_OWNER = 1, 0, -1

local kind = redis.call('TYPE', key)
kind = type(kind) == 'table' and kind.ok or kind
if kind == 'none' then return MISSING end
if kind ~= 'string' or redis.call('GET', key) ~= owner then return NOT_OWNER end
redis.call('PEXPIRE', key, string.format('%.0f', ttl))
return EXTENDED
