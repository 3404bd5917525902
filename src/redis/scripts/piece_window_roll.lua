-- piece_window_roll.lua: a sliding-window ("sw") counter rolled over to the current aligned
-- window. Included by acquire.lua and charge.lua: src/lua/mod.rs (Scripts::load) puts this
-- file before each, so inside batch.lua it is defined again in acquire_one and charge_one.
--
-- Expects in scope: no local of the script (it runs before the script's own text); it uses
-- only Redis's globals (redis, tonumber, math). Adds one local: window_roll.
--
-- window_roll(key, window_ms, now) reads the counter's hash (HMGET key w c p: the stored
-- window's index, its count, the count of the window before it), writes nothing, and returns
--   w     window_ms in µs
--   idx   the current window's index, floor(now / w) (now: Redis TIME in µs)
--   cur   the current window's count: c if the stored window is idx, else 0
--   prev  the previous window's count: c if the stored window is idx - 1, p if it is idx,
--         else 0
local function window_roll(key, window_ms, now)
  local w = window_ms * 1000
  local idx = math.floor(now / w)
  local h = redis.call('HMGET', key, 'w', 'c', 'p')
  local stored, cur, prev = tonumber(h[1]), tonumber(h[2]) or 0, tonumber(h[3]) or 0
  if stored == idx - 1 then
    prev, cur = cur, 0
  elseif stored ~= idx then
    prev, cur = 0, 0
  end
  return w, idx, cur, prev
end
