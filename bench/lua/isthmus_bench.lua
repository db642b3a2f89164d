-- The nginx side of bench/lua_bench.py: echo calls from one worker through resty.isthmus over
-- shm:// and, beside it, through the hand-made alternative it replaces (a cosocket to a Unix
-- socket with a 4-byte length before each message), timed per call with CLOCK_MONOTONIC.

local ffi = require "ffi"
local isthmus = require "resty.isthmus"
local cjson = require "cjson.safe"

ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } isthmus_bench_timespec;
int clock_gettime(int clock, isthmus_bench_timespec *ts);
]]

local CLOCK_MONOTONIC = 1
local PATH = "/bench.Echo/Unary"
local ts = ffi.new("isthmus_bench_timespec")

local function now_us()
    ffi.C.clock_gettime(CLOCK_MONOTONIC, ts)
    return tonumber(ts.tv_sec) * 1e6 + tonumber(ts.tv_nsec) / 1e3
end

local _M = {}

local shm_target, uds_path
local spinning, sleeping -- the worker's channels: the default, and one that never spins

function _M.init(target, uds)
    shm_target, uds_path = target, uds
    spinning = assert(isthmus.connect(target))
    sleeping = assert(isthmus.connect(target, { spin = false }))
end

local function len4(n)
    return string.char(math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256)
end

-- One echo through the cosocket: the message in one send, then receive(4) and receive(len).
local function cosocket_echo(sock, framed)
    assert(sock:send(framed))
    local head = assert(sock:receive(4))
    local a, b, c, d = head:byte(1, 4)
    return assert(sock:receive(((a * 256 + b) * 256 + c) * 256 + d))
end

local function cosocket()
    local sock = ngx.socket.tcp()
    assert(sock:connect("unix:" .. uds_path))
    return sock
end

-- For ngx.run_worker_thread (a Lua VM of its own in nginx's thread pool): a blocking call on
-- a channel of that VM.
local thread_channel
function _M.thread_echo(target, payload)
    if not thread_channel then
        thread_channel = assert(isthmus.connect(target))
    end
    local ok, reply = thread_channel:unary(PATH, payload)
    return ok and #reply or tostring(reply)
end

local function caller(system, payload)
    if system == "lua-isthmus-shm" then
        return function() local ok, r = spinning:unary(PATH, payload) return ok and r end
    elseif system == "lua-isthmus-shm-nospin" then
        return function() local ok, r = sleeping:unary(PATH, payload) return ok and r end
    elseif system == "lua-isthmus-worker-thread" then
        return function()
            local ok, n = ngx.run_worker_thread("isthmus", "isthmus_bench", "thread_echo", shm_target, payload)
            return ok and n == #payload and payload
        end
    elseif system == "lua-cosocket-uds" then
        local sock, framed = cosocket(), len4(#payload) .. payload
        return function() return cosocket_echo(sock, framed) end, sock
    end
    error("no system " .. tostring(system))
end

-- GET /seq?system=S&size=N&n=CALLS: CALLS sequential echoes of N bytes; p50, p99 and total.
function _M.seq()
    local args = ngx.req.get_uri_args()
    local size, n = tonumber(args.size), tonumber(args.n)
    local payload = string.rep("x", size)
    local call, sock = caller(args.system, payload)
    for _ = 1, math.min(n, 1000) do -- warm-up
        assert(call() == payload, "a warm-up echo failed")
    end
    local lat = {}
    local start = now_us()
    for i = 1, n do
        local t = now_us()
        local reply = call()
        lat[i] = now_us() - t
        if reply ~= payload then
            ngx.say(cjson.encode({ error = "echo " .. i .. " failed" }))
            return
        end
    end
    local total = now_us() - start
    if sock then
        sock:close()
    end
    table.sort(lat)
    ngx.say(cjson.encode({
        p50_us = lat[math.floor(n * 0.5)],
        p99_us = lat[math.floor(n * 0.99)],
        total_s = total / 1e6,
    }))
end

-- Under wrk: one 512 B echo per request, or none, or none but one yield of the request's
-- coroutine to the event loop (the least a call that does not block the worker adds).
local body = string.rep("x", 512)
local framed = len4(#body) .. body

function _M.http(system)
    if system == "lua-cosocket-uds-http" then
        local sock = cosocket()
        local r = cosocket_echo(sock, framed)
        sock:setkeepalive(0, 64)
        return ngx.print(#r)
    end
    local ch = (system == "lua-isthmus-shm-http" and spinning) or (system == "lua-isthmus-shm-nospin-http" and sleeping)
    if not ch then
        if system == "nginx-lua-yield-http" then
            ngx.sleep(0) -- no call, but the yield any call that does not block the worker makes
        end
        return ngx.print(#body) -- no call: the ceiling
    end
    local ok, r = ch:unary(PATH, body)
    if not ok then
        return ngx.exit(502)
    end
    ngx.print(#r)
end

return _M
