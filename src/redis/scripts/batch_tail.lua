local run = {acquire_one, complete_one, release_one, lease_release_one, slot_release_one,
  charge_one}

local count = tonumber(ARGV[1]) or error('batch.lua: ARGV[1] (count) is not a number', 0)
local out = {}
local ki, ai = 1, 2
for _ = 1, count do
  local f, nk, na = run[tonumber(ARGV[ai])], tonumber(ARGV[ai + 1]), tonumber(ARGV[ai + 2])
  if not f or not nk or not na then error('batch.lua: bad sub-call header', 0) end
  ai = ai + 3
  local k, a = {}, {}
  for i = 1, nk do k[i] = KEYS[ki + i - 1] end
  for i = 1, na do a[i] = ARGV[ai + i - 1] end
  ki, ai = ki + nk, ai + na
  local ok, reply = pcall(f, k, a)
  if ok and type(reply) == 'table' then
    out[#out + 1] = #reply
    for i = 1, #reply do out[#out + 1] = reply[i] end
  elseif ok and type(reply) == 'number' then
    out[#out + 1] = -2
    out[#out + 1] = reply
  elseif ok then
    out[#out + 1] = -1
    out[#out + 1] = 'batch.lua: a sub-call replied neither an array nor an integer'
  else
    out[#out + 1] = -1
    out[#out + 1] = tostring(type(reply) == 'table' and reply.err or reply)
  end
end
return out
