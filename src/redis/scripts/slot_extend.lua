-- slot_extend.lua: the caller's concurrency slot (taken by acquire.lua) lives window_ms more
-- from now, atomically, only if it is still held. A slot that expired is not revived (the
-- slot may since have gone to another request): it is removed, and the reply says so.
--
-- KEYS[1]  concurrency key: a sorted set of the requests holding a slot, scored by expiry (µs)
-- ARGV[1]  member: the nonce acquire.lua stored (must not be empty)
-- ARGV[2]  window_ms: integer > 0, the slot's new lifetime from now
--
-- Reply: integer
--    1 EXTENDED  the slot was held: its expiry is now + window_ms, the key lives as long
--    0 MISSING   no live slot (expired, released or never taken); nothing written but the
--                removal of an expired one

local function bad(what) error('slot_extend.lua: ' .. what, 0) end

local key = KEYS[1] or bad('KEYS[1] (concurrency key) is missing')
local member = ARGV[1]
if member == nil or member == '' then bad('ARGV[1] (member) is missing') end
local window_ms = tonumber(ARGV[2])
if window_ms == nil or window_ms % 1 ~= 0 or window_ms < 1 then
  bad('ARGV[2] (window_ms) must be an integer >= 1, got ' .. tostring(ARGV[2]))
end

local kind = redis.call('TYPE', key)
kind = type(kind) == 'table' and kind.ok or kind
if kind ~= 'zset' then return 0 end
local score = tonumber(redis.call('ZSCORE', key, member))
if score == nil then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if score <= now then
  redis.call('ZREM', key, member)
  return 0
end
redis.call('ZADD', key, 'XX', string.format('%.0f', now + window_ms * 1000), member)
if redis.call('PTTL', key) < window_ms then redis.call('PEXPIRE', key, ARGV[2]) end
return 1
