-- Requests for bench/run. Arguments (after `--`): mode, prefix, keys, and optionally the
-- path (default /v1/transfers) and an Authorization value.
--   none    POST without Idempotency-Key (direct upstream, or idemgate pass-through)
--   new     a key never used before on every request: prefix-<thread>-<n>
--   replay  cycles through prefix-0 .. prefix-<keys-1>, created beforehand
-- Every request is formatted once, in init(), as wrk does for a request without a script:
-- wrk.format() on each request cost wrk about 1.5 us of CPU per request more than a fixed
-- request, on the two cores it shares with what it measures, so the keyed cases would have
-- paid for the load generator's Lua and the pass-through would not. A new key is spliced
-- into a request formatted with a placeholder key.
-- done() prints one line starting with BENCH, JSON, for bench/measure.py.

local body = '{"from":"acc-1","to":"acc-2","amount":1250,"currency":"EUR"}'
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end

local path = "/v1/transfers"
local authorization = nil

local function format(key)
  local headers = { ["Content-Type"] = "application/json" }
  if key then
    headers["Idempotency-Key"] = key
  end
  if authorization then
    headers["Authorization"] = authorization
  end
  return wrk.format("POST", path, headers, body)
end

function init(args)
  if args[4] and args[4] ~= "" then
    path = args[4]
  end
  if args[5] and args[5] ~= "" then
    authorization = args[5]
  end
  mode = args[1] or "none"
  local prefix = args[2] or "k"
  local keys = tonumber(args[3] or "1")
  n = (tid or 1) * 7919 -- spread the threads over the replay keys
  if mode == "none" then
    fixed = format(nil)
  elseif mode == "new" then
    local placeholder = "KEY-PLACEHOLDER"
    local template = format(placeholder)
    local at = string.find(template, placeholder, 1, true)
    before = string.sub(template, 1, at - 1) .. prefix .. "-" .. (tid or 1) .. "-"
    after = string.sub(template, at + #placeholder)
  elseif mode == "replay" then
    replays = {}
    for i = 0, keys - 1 do
      replays[i] = format(prefix .. "-" .. i)
    end
    count = keys
  else
    error("wrk.lua: unknown mode " .. mode)
  end
end

function request()
  if fixed then
    return fixed
  end
  n = n + 1
  if before then
    return before .. n .. after
  end
  return replays[n % count]
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH {"requests":%d,"duration_us":%d,"socket_errors":%d,"non2xx":%d,' ..
    '"p50_us":%d,"p90_us":%d,"p99_us":%d,"mean_us":%.1f}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean))
end
