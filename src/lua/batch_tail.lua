end

local count = tonumber(ARGV[1]) or error('batch.lua: ARGV[1] (count) is not a number', 0)
local out = {}
local ki, ai = 1, 2
for _ = 1, count do
  local nk, na = tonumber(ARGV[ai]), tonumber(ARGV[ai + 1])
  if not nk or not na then error('batch.lua: bad sub-call header', 0) end
  ai = ai + 2
  local k, a = {}, {}
  for i = 1, nk do k[i] = KEYS[ki + i - 1] end
  for i = 1, na do a[i] = ARGV[ai + i - 1] end
  ki, ai = ki + nk, ai + na
  local ok, reply = pcall(acquire_one, k, a)
  if ok then
    out[#out + 1] = #reply
    for i = 1, #reply do out[#out + 1] = reply[i] end
  else
    out[#out + 1] = -1
    out[#out + 1] = tostring(type(reply) == 'table' and reply.err or reply)
  end
end
return out
