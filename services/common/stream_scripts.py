"""The Lua scripts behind streams.py's guarantees (its module docstring): each runs atomically
in Redis, which is what makes a hand-off exactly-once, a trim safe and an ack fenced.
"""

# KEYS: source stream, destination stream. ARGV: group, entry id, then field/value pairs.
# Publishing only when XACK returned 1 is the exactly-once guard: of all consumers holding the
# same entry, only the first to hand it off still finds it pending.
ACK_AND_ADD = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  return redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
end
return false
"""

# KEYS: stream. ARGV: group, consumer, entry ids. Resets the idle time of the entries this
# consumer still owns (JUSTID leaves the delivery counter alone), so a live consumer's long job
# is not taken over; entries another consumer has claimed meanwhile are left to it.
RENEW = """
local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], '0'}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then args[#args + 1] = ARGV[i] end
end
if #args == 5 then return 0 end
args[#args + 1] = 'JUSTID'
return #redis.call(unpack(args))
"""

# KEYS: stream. ARGV: group, consumer, cursor, count, then the ids this consumer's live jobs
# hold. Looks at this consumer's own pending entries after `cursor` and takes back (XCLAIM to
# itself: the fields, and one more delivery) up to `count` that no live job holds, those whose
# delivery reply was lost with a connection. XPENDING counts no delivery, so a live job's
# entry is left alone. Returns {cursor, entries, {id, deliveries, ...}}; the cursor is false
# once the walk has seen the whole list. Atomic: another consumer cannot take one meanwhile.
TAKE_BACK_OWN = """
local held = {}
for i = 5, #ARGV do held[ARGV[i]] = true end
local count = tonumber(ARGV[4])
local page = count + #ARGV - 4
local rows = redis.call('XPENDING', KEYS[1], ARGV[1], '(' .. ARGV[3], '+', page, ARGV[2])
local ids, deliveries, cursor = {}, {}, false
for i, row in ipairs(rows) do
  if #ids == count then cursor = rows[i - 1][1]; break end
  if not held[row[1]] then
    ids[#ids + 1] = row[1]
    deliveries[#deliveries + 1] = row[1]
    deliveries[#deliveries + 1] = row[4] + 1
  end
end
if not cursor and #rows == page then cursor = rows[#rows][1] end
if #ids == 0 then return {cursor, {}, {}} end
return {cursor, redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, unpack(ids)), deliveries}
"""

# KEYS: stream. ARGV: '~' (approximate) or '=' (exact). Returns {min id kept, entries removed},
# or false when the stream or its groups are missing. Atomic, so a group created or a read
# made while we compute cannot slip below the bound. Entry ids are compared as (ms, seq) with
# decimal strings compared by length first, which is exact for any 64-bit value.
TRIM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
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
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return false end
local min_id = nil
for _, g in ipairs(groups) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  local needed = info['last-delivered-id']
  if info['pending'] > 0 then
    needed = redis.call('XPENDING', KEYS[1], info['name'])[2]
  end
  if min_id == nil or less(needed, min_id) then min_id = needed end
end
return {min_id, redis.call('XTRIM', KEYS[1], 'MINID', ARGV[1], min_id)}
"""


# KEYS: stream. ARGV: idle ms. Deletes, in every group, the consumers that own no pending
# entry and have been idle at least that long; returns how many. Atomic: a consumer cannot
# take an entry between the check and the delete (deleting one with pending entries would
# drop them from the pending list, and nothing would deliver them again).
DELETE_IDLE_CONSUMERS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local deleted = 0
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local group = {}
  for i = 1, #g, 2 do group[g[i]] = g[i + 1] end
  for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], group['name'])) do
    local info = {}
    for i = 1, #c, 2 do info[c[i]] = c[i + 1] end
    if info['pending'] == 0 and info['idle'] >= tonumber(ARGV[1]) then
      redis.call('XGROUP', 'DELCONSUMER', KEYS[1], group['name'], info['name'])
      deleted = deleted + 1
    end
  end
end
return deleted
"""


# Fenced calls (common/fencing.py): a trainer holding its run's lease acks and claims only
# while the run's fencing number is still its own; an older holder's call is refused with a
# FENCED error and changes nothing. KEYS: stream, fence key. ARGV: the caller's fence first.
_FENCE_GUARD = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then
  return redis.error_reply('FENCED fencing number ' ..
    tostring(redis.call('GET', KEYS[2])) .. '; this one ' .. ARGV[1])
end
"""

# ARGV: fence, group, entry id.
FENCED_ACK = _FENCE_GUARD + "return redis.call('XACK', KEYS[1], ARGV[2], ARGV[3])\n"

# ARGV: fence, group, consumer, min idle ms, start id, count. XAUTOCLAIM's reply, raw.
FENCED_AUTOCLAIM = (
    _FENCE_GUARD
    + "return redis.call('XAUTOCLAIM', KEYS[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], "
    + "'COUNT', ARGV[6])\n"
)
