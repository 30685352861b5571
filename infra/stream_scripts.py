"""The Lua scripts of the Redis stream transport (infra/streams.py), each run with EVAL so its reads and
writes are one atomic step on the server: no consumer group appears, moves or acks in between.

- TRIM_ACKED_SCRIPT: the trim floor over every group of a stream and the XTRIM MINID below it
  (`streams.trim_acked`; the module docstring of infra/streams.py says what the floor is and why).
- SET_COUNTS_SCRIPT: set or raise the delivery counters of entries still pending to one consumer
  (`StreamConsumer`'s count-on-use bookkeeping).

Kept apart from the Python so streams.py reads as the delivery rules, and so each script can be read whole.
"""

# The trim floor and the XTRIM in one atomic step. Ids compare as (ms, seq) decimal strings by
# length then text, exact for any 64-bit part (Lua numbers are doubles).
TRIM_ACKED_SCRIPT = """
local function less(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if am ~= bm then
    if #am ~= #bm then return #am < #bm end
    return am < bm
  end
  if #as ~= #bs then return #as < #bs end
  return as < bs
end
if redis.call('EXISTS', KEYS[1]) == 0 then return {'', 0} end
local floor = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local f = {}
  for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
  local bound = f['last-delivered-id']
  if f['pending'] > 0 then
    local oldest = redis.call('XPENDING', KEYS[1], f['name'])[2]
    if less(oldest, bound) then bound = oldest end
  end
  if floor == nil or less(bound, floor) then floor = bound end
end
if floor == nil or floor == '0-0' then return {floor or '', 0} end
return {floor, redis.call('XTRIM', KEYS[1], 'MINID', ARGV[1], floor)}
"""


# Set (ARGV[3] 'set') or raise (ARGV[3] 'add') the delivery counters of entries still pending to this
# consumer; -1 for an entry that is not (acked, or another consumer's now). XCLAIM JUSTID with RETRYCOUNT
# sets the counter, renews the idle time and leaves the entry where it is.
SET_COUNTS_SCRIPT = """
local out = {}
for i = 4, #ARGV, 2 do
  local id, n = ARGV[i], tonumber(ARGV[i + 1])
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    if ARGV[3] == 'add' then n = p[1][4] + n end
    if n < 0 then n = 0 end
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'RETRYCOUNT', n, 'JUSTID')
    out[#out + 1] = n
  else
    out[#out + 1] = -1
  end
end
return out
"""
