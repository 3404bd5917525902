-- piece_cancel_marker.lua: the cancellation marker a release script sets when the caller
-- gave up on its acquire call. Included by release.lua, lease_release.lua and
-- slot_release.lua: src/lua/mod.rs (Scripts::load) puts this file before each, so inside
-- batch.lua it is defined again in release_one, lease_release_one and slot_release_one.
--
-- Expects in scope: KEYS and ARGV, which it reads (KEYS[2] the marker, ARGV[2] its TTL):
-- Redis's globals when the script runs alone, the parameters of <script>_one(KEYS, ARGV)
-- inside batch.lua. No local of the script (it runs before the script's own text): the
-- script's error function is passed in. Adds one local: set_cancel_marker.
--
-- set_cancel_marker(bad, key, what): nothing without KEYS[2]; with it, ARGV[2]
-- (marker_ttl_ms) must be an integer >= 1 and KEYS[2] must not be `key`, the script's own
-- key (`what` names it in the error), else bad(message), the script's own error; then
-- SET KEYS[2] "1" PX ARGV[2]. The caller calls it before it looks at `key`.
local function set_cancel_marker(bad, key, what)
  if KEYS[2] then
    local ttl = tonumber(ARGV[2])
    if ttl == nil or ttl % 1 ~= 0 or ttl < 1 then
      bad('ARGV[2] (marker_ttl_ms) must be an integer >= 1, got ' .. tostring(ARGV[2]))
    end
    if KEYS[2] == key then bad('the marker and the ' .. what .. ' are the same key') end
    redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
  end
end
