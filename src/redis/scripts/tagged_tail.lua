end
local reply = body(KEYS, ARGV)
if type(reply) ~= 'table' then return {TAG, -2, reply} end
local out = {TAG, #reply}
for i = 1, #reply do out[i + 2] = reply[i] end
return out
