-- The Lua side of lua/tests: each case makes real calls through resty.isthmus from inside an
-- nginx worker (GET /case/<name>?target=...&...) and answers with what it saw, as JSON, for
-- test_nginx.py to check. The channels are the worker's, one per target, shared by requests.

local isthmus = require "resty.isthmus"
local cjson = require "cjson.safe"

local _M = {}

local proto
local channels = {}
local cases = {}

local ECHO = "/conformance.Echo/"

local function channel(target)
    local ch = channels[target]
    if not ch then
        ch = assert(isthmus.connect(target, { proto = proto }))
        channels[target] = ch
    end
    return ch
end

-- What the calls made in init_worker_by_lua saw (init_worker's `target`; none without one).
local init_results

-- Loads the proto; with a `target`, also calls it from init_worker_by_lua, a phase that cannot
-- yield (the module's blocking path), on the channel the worker's requests then share.
function _M.init_worker(proto_path, target)
    proto = assert(isthmus.load_proto({ proto_path }))
    if target and target ~= "" then
        local phase = ngx.get_phase()
        local ch = channel(target)
        init_results = {}
        for _, name in ipairs({ "unary", "bidi", "stream_metadata" }) do
            local r = cases[name](ch, { n = 3 })
            r.phase = phase
            init_results[name] = r
        end
    end
end

-- What the calls made in init_by_lua, in nginx's master, saw (init_master's targets).
local master_results

-- In the master (init_by_lua): loads the proto, connects to each of `targets` (separated by
-- spaces) and makes one call on each, blocking; the workers, forked after, inherit the channels
-- (each worker makes connections of its own, ADR 0030) and find them under the same targets.
function _M.init_master(proto_path, targets)
    proto = assert(isthmus.load_proto({ proto_path }))
    master_results = {}
    for target in targets:gmatch("%S+") do
        local r = cases.unary(channel(target), {})
        r.phase = ngx.get_phase()
        master_results[target] = r
    end
end

-- From set_by_lua, a phase that cannot yield (a call blocks the worker), with no timeouts of
-- their own: a unary call the server answers after `sleep_ms`, and a wait for a fresh
-- channel to leave IDLE (it never connects unasked). What each ended with, as JSON.
function _M.set_calls(target, sleep_ms)
    local out = { phase = ngx.get_phase() }
    local ok, r = channel(target):unary(ECHO .. "Unary", { sleep_ms = tonumber(sleep_ms), seq = 95 })
    out.unary = ok and "OK" or r.name
    local idle = assert(isthmus.connect(target))
    local changed, err = idle:wait_state("IDLE")
    out.wait = changed and "changed" or err.name
    idle:close()
    return cjson.encode(out)
end

-- From a TLS handshake's `ssl_*_by_lua` phase: a unary call the server answers after
-- `sleep_ms` (no spin catches its reply), and what it ended with, kept in the shared dict under
-- "ssl <phase>" for the server's location to answer.
function _M.ssl_call(target, sleep_ms)
    local ok, r = channel(target):unary(ECHO .. "Unary", { sleep_ms = sleep_ms, seq = 96 })
    ngx.shared.isthmus_tests:set("ssl " .. ngx.get_phase(), ok and "OK" or r.name)
end

-- A bidi stream with no timeout, started from content_by_lua (a phase that yields), and a
-- receive on it from header_filter_by_lua (one that cannot): the server never answers, as it
-- waits for a request. What the receive ended with goes into the header X-Step.
function _M.filter_stream_start(target)
    local st = assert(channel(target):stream(ECHO .. "Bidi"))
    ngx.ctx.stream = st
    ngx.say("started")
end

-- In nginx's master (init_by_lua, which blocks): a receive with a timeout of its own on a
-- stream nothing answers, which makes the module's step queue there; the worker forked after
-- must make its own. What it ended with is `master_recv`'s.
local master_recv

function _M.master_recv_timeout(proto_path, target)
    proto = proto or assert(isthmus.load_proto({ proto_path }))
    local st = assert(channel(target):stream(ECHO .. "Bidi", { timeout = 30 }))
    local ok, err = st:recv(0.05)
    master_recv = ok and "received" or (err.name .. (err.timeout and " timeout" or ""))
    st:close()
end

function cases.master_recv()
    return { seen = master_recv }
end

-- From header_filter_by_lua (which cannot yield), on the stream filter_stream_start made: a
-- receive with a timeout of its own (`wait`), then with `echo` an echo through the same stream.
function _M.filter_recv_timeout()
    local st = ngx.ctx.stream
    if st == nil then
        return
    end
    local ok, err = st:recv(tonumber(ngx.var.arg_wait))
    ngx.header["X-Timeout"] = ok and "received" or (err.name .. (err.timeout and " timeout" or ""))
    if ngx.var.arg_echo == "1" then
        local sent, serr = st:send({ seq = 7 })
        local got, m = st:recv(5)
        ngx.header["X-Echo"] = not sent and serr.name or got and tostring(m.seq) or m.name
    end
    st:close()
end

function _M.filter_stream_step()
    local st = ngx.ctx.stream
    if st == nil then
        return
    end
    local ok, r = st:recv()
    ngx.header["X-Step"] = ngx.get_phase() .. " " .. (ok and "OK" or r.name)
    -- The next step finds the call over.
    local again, r2 = st:recv()
    ngx.header["X-Step-Again"] = again and "OK" or r2.name
    st:close()
end

-- A light thread waits for a stream's headers (the echo server sends them with its first
-- reply) and is killed while it waits; then a message is sent, whose echo header_filter
-- receives (`filter_recv_step`), where the worker cannot yield.
function _M.filter_killed_headers_start(target)
    local st = assert(channel(target):stream(ECHO .. "Bidi", { timeout = 30 }))
    ngx.ctx.stream = st
    local waiter = ngx.thread.spawn(function()
        return st:headers()
    end)
    ngx.sleep(0.1)
    ngx.ctx.killed = ngx.thread.kill(waiter) and "yes" or "no"
    assert(st:send({ seq = 7 }))
    ngx.say("started")
end

function _M.filter_recv_step()
    local st = ngx.ctx.stream
    if st == nil then
        return
    end
    ngx.header["X-Killed"] = ngx.ctx.killed
    local ok, m = st:recv()
    ngx.header["X-Step"] = ok and tostring(m.seq) or m.name
    local headers = st:headers()
    ngx.header["X-Headers"] = headers and "OK" or "failed"
    st:close()
end

-- A light thread receives on a stream while another receive waits there: refused, as a
-- cosocket refuses a second reader; the stream goes on.
function cases.two_receivers(ch, args)
    local st = assert(ch:stream(ECHO .. "Bidi", { timeout = 5 }))
    local first = ngx.thread.spawn(function()
        return st:recv()
    end)
    ngx.sleep(0.05)
    local second, err = st:recv()
    assert(st:send({ seq = 1 }))
    local _, ok1, m1 = ngx.thread.wait(first)
    assert(st:send({ seq = 2 }))
    local ok3, m3 = st:recv()
    st:close()
    return {
        ok = true,
        second = second and "received" or err.name,
        first = ok1 and tonumber(m1.seq) or m1.name,
        after = ok3 and tonumber(m3.seq) or m3.name,
    }
end

function cases.master_results()
    return { ok = master_results ~= nil, results = master_results }
end

local function failure(err)
    return { ok = false, code = err.code, name = err.name, message = err.message,
        failed = err.trailers["x-failed"] }
end

-- Protobuf by hand, for messages too large to pass through JSON quickly: an EchoRequest with
-- only `payload` (field 1), and the payload field read back from an EchoReply.
local function varint(n)
    local out = {}
    repeat
        local b = n % 128
        n = (n - b) / 128
        out[#out + 1] = string.char(n > 0 and b + 128 or b)
    until n == 0
    return table.concat(out)
end

local function payload_of(bytes)
    local pos, n, shift = 2, 0, 1
    assert(bytes:byte(1) == 0x0a, "field 1 first")
    while true do
        local b = bytes:byte(pos)
        pos = pos + 1
        n = n + (b % 128) * shift
        shift = shift * 128
        if b < 128 then break end
    end
    return bytes:sub(pos, pos + n - 1)
end

function cases.unary(ch, args)
    local ok, r, meta = ch:unary(ECHO .. "Unary", { payload = ngx.encode_base64("hello"), seq = 7 },
        { timeout = 30, metadata = { ["x-echo"] = "from-lua" } })
    if not ok then return failure(r) end
    return { ok = true, payload = ngx.decode_base64(r.payload), seq = r.seq, time_left_ms = r.time_left_ms,
        header = meta.headers["x-echo"], trailer = meta.trailers["x-echo"] }
end

-- Unary calls whose requests go compressed (over HTTP/2), each echoed; then a compression
-- the library does not know, refused before the call starts.
function cases.compressed(ch, args)
    local payloads = {}
    for _, compression in ipairs({ "gzip", "deflate" }) do
        local text = string.rep(compression .. " me ", 200)
        local ok, r = ch:unary(ECHO .. "Unary", { payload = ngx.encode_base64(text), seq = 5 },
            { timeout = 30, compression = compression })
        if not ok then return failure(r) end
        payloads[compression] = ngx.decode_base64(r.payload) == text
    end
    local ok, err = ch:unary(ECHO .. "Unary", { seq = 1 }, { timeout = 30, compression = "zstd" })
    return { ok = true, echoed = payloads, refused = not ok and err.name }
end

function cases.unary_raw(ch, args)
    local ok, bytes = proto:encode("conformance.EchoRequest", { payload = ngx.encode_base64("raw"), seq = 3 })
    assert(ok, tostring(bytes))
    local ok2, reply = ch:unary(ECHO .. "Unary", bytes, { raw = true })
    if not ok2 then return failure(reply) end
    local dok, t = proto:decode("conformance.EchoReply", reply)
    assert(dok, tostring(t))
    return { ok = true, kind = type(reply), payload = ngx.decode_base64(t.payload), seq = t.seq }
end

function cases.server_stream(ch, args)
    local st, err = ch:stream(ECHO .. "ServerStream", { timeout = 30 })
    if not st then return failure(err) end
    assert(st:send({ count = tonumber(args.count), size = tonumber(args.size) }, true))
    local seqs, sizes = {}, {}
    while true do
        local ok, m = st:recv()
        if not ok then return failure(m) end
        if m == nil then break end
        seqs[#seqs + 1] = tonumber(m.seq or 0)
        sizes[#sizes + 1] = #ngx.decode_base64(m.payload or "")
    end
    st:close()
    return { ok = true, seqs = seqs, sizes = sizes }
end

-- Methods whose client sends one request, through ch:stream with no half-close asked for: the
-- send half-closes (as generated clients do), so a server that waits for it answers; a second
-- send is refused as after close_send, and close_send itself is harmless.
function cases.one_request_streams(ch, args)
    local st, err = ch:stream(ECHO .. "ServerStream", { timeout = 30 })
    if not st then return failure(err) end
    assert(st:send({ count = 2, size = 1 }))
    local seqs = {}
    while true do
        local ok, m = st:recv(10)
        if not ok then return failure(m) end
        if m == nil then break end
        seqs[#seqs + 1] = tonumber(m.seq or 0)
    end
    local again, aerr = st:send({ count = 1 })
    local closed = st:close_send()
    st:close()
    local un, uerr = ch:stream(ECHO .. "Unary", { timeout = 30 })
    if not un then return failure(uerr) end
    assert(un:send({ seq = 12 }))
    local ok, m = un:recv(10)
    if not ok then return failure(m) end
    local ok2, after = un:recv(10)
    un:close()
    return { ok = true, seqs = seqs, again = again or aerr.name, closed = closed, unary = tonumber(m.seq),
        ended = ok2 and after == nil }
end

function cases.client_stream(ch, args)
    local st, err = ch:stream(ECHO .. "ClientStream", { timeout = 30 })
    if not st then return failure(err) end
    for i = 1, tonumber(args.n) do
        -- Empty payloads: the servers check each against a pattern of its length and seq.
        assert(st:send({ seq = i }))
    end
    assert(st:close_send())
    local ok, summary = st:recv()
    if not ok then return failure(summary) end
    local ok2, after = st:recv()
    st:close()
    return { ok = true, count = tonumber(summary.count), bytes = tonumber(summary.bytes or 0), ended = ok2 and after == nil }
end

function cases.bidi(ch, args)
    local st, err = ch:stream(ECHO .. "Bidi", { timeout = 30 })
    if not st then return failure(err) end
    local seqs = {}
    for i = 1, tonumber(args.n) do
        assert(st:send({ payload = ngx.encode_base64("ping"), seq = i }))
        local ok, m = st:recv()
        if not ok then return failure(m) end
        seqs[#seqs + 1] = tonumber(m.seq)
    end
    assert(st:close_send())
    local ok, last = st:recv()
    st:close()
    return { ok = true, seqs = seqs, ended = ok and last == nil }
end

-- A stream the server failed: the receive gives its status and trailers, stream.trailers
-- holds them, and a later send gives the same error (it said CANCELLED, "the call is over").
function cases.send_after_failure(ch, args)
    local st, err = ch:stream(ECHO .. "Bidi", { timeout = 30 })
    if not st then return failure(err) end
    assert(st:send({ seq = 1, fail_with = 7, fail_message = "no" }))
    local ok, rerr = st:recv()
    local sent, serr = st:send({ seq = 2 })
    local out = {
        received = ok, received_name = rerr and rerr.name, sent = sent, sent_name = serr and serr.name,
        sent_message = serr and serr.message, failed_marked = st.trailers and st.trailers["x-failed"],
    }
    st:close()
    return out
end

-- Sends after the half-close (a send with `last`, and one after close_send on another
-- stream) fail INTERNAL, as grpc-go's, and the stream goes on: the echo of the one request,
-- then the end. A whole-number metadata value goes in full.
function cases.send_after_half_close(ch, args)
    local out = {}
    for _, way in ipairs({ "last", "close_send" }) do
        local st, err = ch:stream(ECHO .. "Bidi", { timeout = 30 })
        if not st then return failure(err) end
        if way == "last" then
            assert(st:send({ seq = 1 }, true))
        else
            assert(st:send({ seq = 1 }))
            assert(st:close_send())
        end
        local sent, serr = st:send({ seq = 2 })
        local ok, m = st:recv()
        local ended, last = st:recv()
        out[way] = { sent = sent, err = not sent and serr.name or nil, message = serr and serr.message,
            seq = ok and m and tonumber(m.seq), ended = ended and last == nil }
        st:close()
    end
    local ok, r, meta = ch:unary(ECHO .. "Unary", { seq = 3 }, { timeout = 30, metadata = { ["x-echo"] = 123456789012345 } })
    out.header = ok and meta.headers["x-echo"] or failure(r).name
    return out
end

function cases.cancel(ch, args)
    local st, err = ch:stream(ECHO .. "Bidi", { timeout = 30 })
    if not st then return failure(err) end
    assert(st:send({ payload = ngx.encode_base64("ping"), seq = tonumber(args.seq) }))
    local ok, m = st:recv()
    if not ok then return failure(m) end
    st:cancel()
    local ok2, err2 = st:recv()
    st:close()
    if ok2 then return { ok = true, after_cancel = "a message" } end
    return failure(err2)
end

-- A light thread waits in a unary call the server answers after a minute, with no deadline,
-- when the request ends (ngx.exit aborts the thread): its operation is left with nobody waiting
-- for it.
function cases.orphan_unary(ch, args)
    local waits = false
    ngx.thread.spawn(function()
        waits = true
        ch:unary(ECHO .. "Unary", { sleep_ms = 60000, seq = tonumber(args.seq) })
    end)
    while not waits do
        ngx.sleep(0.01)
    end
    ngx.sleep(0.1)
    ngx.say(cjson.encode({ ok = true }))
    return ngx.exit(200)
end

-- A light thread starts a bidirectional stream on a channel still connecting (its first call)
-- when the request ends (ngx.exit aborts the thread): its start finishes with nobody to take
-- the stream.
-- A light thread starts a stream on a channel of its own, still connecting, and the request
-- ends (ngx.exit) while the start waits. A start that finished at once (the connection was
-- quicker than this worker) is no such case: that stream is cancelled here and `at_once` told,
-- for the test to try again. `stats` with `orphan=1` reads this channel.
local orphans = {}

function cases.orphan_stream(ch, args)
    local own = assert(isthmus.connect(args.target, { proto = proto }))
    orphans[args.target] = own
    local at_once
    ngx.thread.spawn(function()
        at_once = own:stream(ECHO .. "Bidi") -- runs on until its first yield, before spawn returns
    end)
    if at_once then
        at_once:cancel()
        return { ok = true, at_once = true }
    end
    ngx.say(cjson.encode({ ok = true, at_once = false }))
    return ngx.exit(200)
end

-- A receive bounded on its own (`wait` seconds) with nothing sent: it times out, and the stream
-- goes on: a refused timeout, then an echo and the end, each receive bounded too.
function cases.recv_timeout(ch, args)
    local st, err = ch:stream(ECHO .. "Bidi", { timeout = 30 })
    if not st then return failure(err) end
    ngx.update_time()
    local t0 = ngx.now()
    local ok, terr = st:recv(tonumber(args.wait))
    ngx.update_time()
    local waited = ngx.now() - t0
    local _, bad = st:recv("soon")
    assert(st:send({ seq = 1 }))
    local got, m = st:recv(10)
    assert(st:close_send())
    local ended, last = st:recv(10)
    st:close()
    return { received = ok, timeout = terr and terr.timeout, name = terr and terr.name, message = terr and terr.message,
        waited = waited, bad_name = bad and bad.name, seq = got and tonumber(m.seq), ended = ended and last == nil }
end

-- A stream its request leaves open, kept past the request in a module table, so that no
-- collection can be what ends it: the request's end does, as a cosocket's.
local kept = {}

function cases.left_stream(ch, args)
    local st, err = ch:stream(ECHO .. "Bidi")
    if not st then return failure(err) end
    assert(st:send({ seq = 1 }))
    local ok, m = st:recv()
    if not ok then return failure(m) end
    kept[args.target] = st
    return { ok = true, seq = tonumber(m.seq) }
end

-- A step on the stream left_stream kept, from a later request.
function cases.kept_stream(ch, args)
    local st = kept[args.target]
    kept[args.target] = nil
    local sent, serr = st:send({ seq = 2 })
    local ok, rerr = st:recv()
    local _, cerr = st:close_send()
    local trailers = 0
    for _ in pairs(st.trailers) do trailers = trailers + 1 end
    st:close()
    return { ok = sent and ok, sent_name = serr and serr.name, message = serr and serr.message,
        received_name = rerr and rerr.name, close_send_name = cerr and cerr.name, trailers = trailers }
end

-- A stream whose request lives on for `wait` seconds between two echoes (prunes pass meanwhile),
-- and replaces its ngx.ctx meanwhile (lua-resty-core puts the new table in the old one's slot).
function cases.slow_request_stream(ch, args)
    local st, err = ch:stream(ECHO .. "Bidi", { timeout = 30 })
    if not st then return failure(err) end
    assert(st:send({ seq = 1 }))
    local ok, m = st:recv()
    if not ok then return failure(m) end
    ngx.ctx = { replaced = true }
    ngx.sleep(tonumber(args.wait))
    local sent, serr = st:send({ seq = 2 })
    if not sent then return failure(serr) end
    ok, m = st:recv()
    if not ok then return failure(m) end
    st:close()
    return { ok = true, seq = tonumber(m.seq) }
end

function cases.fail(ch, args)
    local ok, err = ch:unary(ECHO .. "Unary", { fail_with = tonumber(args.code), fail_message = args.message })
    if ok then return { ok = true } end
    return failure(err)
end

-- A failure after the server sent initial metadata (it reflects x-echo): the error keeps them.
function cases.fail_headers(ch, args)
    local ok, err = ch:unary(ECHO .. "Unary", { fail_with = tonumber(args.code), fail_message = "late" },
        { metadata = { ["x-echo"] = "early" } })
    if ok then return { ok = true } end
    local r = failure(err)
    r.header = err.headers["x-echo"]
    return r
end

-- The lua-resty idiom `ngx.say("failed: ", err)` prints the error's text (it raised, the
-- error's fields being a table's own), and the fields still read and write as before.
function cases.say_error(ch, args)
    local ok, err = ch:unary(ECHO .. "Unary", { fail_with = tonumber(args.code), fail_message = args.message })
    if ok then return { ok = true } end
    ngx.say("failed: ", err)
    ngx.print(err, "\n")
    err.message = "changed"
    local raw = 0
    for _ in pairs(err) do raw = raw + 1 end
    return { ok = false, code = err.code, name = err.name, message = err.message, text = tostring(err),
        concat = "e: " .. err, said_after = err[1], raw_keys = raw, trailers = err.trailers["x-failed"] }
end

-- A failure's details, in hex ("" for none).
function cases.fail_details(ch, args)
    local ok, err = ch:unary(ECHO .. "Unary", { fail_with = tonumber(args.code), fail_message = args.message })
    if ok then return { ok = true } end
    local hex = (err.details or ""):gsub(".", function(c) return string.format("%02x", c:byte()) end)
    return { ok = false, code = err.code, message = err.message, details = hex }
end

function cases.slow(ch, args)
    local opts = { timeout = tonumber(args.timeout) }
    local ok, r = ch:unary(ECHO .. "Unary", { sleep_ms = tonumber(args.sleep), seq = 1 }, opts)
    if not ok then return failure(r) end
    return { ok = true, seq = r.seq }
end

function cases.unknown(ch, args)
    local ok, err = ch:unary("/conformance.Echo/Nope", "", { raw = true })
    if ok then return { ok = true } end
    return failure(err)
end

-- Arguments a C string would cut short, or that are no target, path, metadata or options:
-- each call returns false and its error (it raised, or sent something else), and the channel
-- serves on. The names of the INVALID_ARGUMENT errors, by case; "after": the next call's reply.
function cases.bad_arguments(ch, args)
    local raw = { raw = true, timeout = 30 }
    local calls = {
        path_number = function() return ch:unary(5, "", raw) end,
        path_nul = function() return ch:unary(ECHO .. "Un\0ary", "", raw) end,
        stream_path_nil = function() return ch:stream(nil) end,
        options_string = function() return ch:unary(ECHO .. "Unary", "", "raw") end,
        options_number = function() return ch:unary(ECHO .. "Unary", "", 5) end,
        stream_options_bool = function() return ch:stream(ECHO .. "Bidi", true) end,
        metadata_string = function() return ch:unary(ECHO .. "Unary", "", { raw = true, metadata = "x-a" }) end,
        metadata_list = function() return ch:unary(ECHO .. "Unary", "", { raw = true, metadata = { "x-a", "v" } }) end,
        metadata_key_nul = function()
            return ch:unary(ECHO .. "Unary", "", { raw = true, metadata = { ["x-echo\0x"] = "v" } })
        end,
        metadata_value_bool = function()
            return ch:unary(ECHO .. "Unary", "", { raw = true, metadata = { ["x-echo"] = true } })
        end,
        metadata_values_hole = function()
            return ch:unary(ECHO .. "Unary", "", { raw = true, metadata = { ["x-echo"] = { "a", nil, "c" } } })
        end,
        metadata_values_key = function()
            return ch:unary(ECHO .. "Unary", "", { raw = true, metadata = { ["x-echo"] = { "a", other = "b" } } })
        end,
        target_nul = function() return isthmus.connect(args.target .. "\0more") end,
        target_number = function() return isthmus.connect(5) end,
        connect_options_string = function() return isthmus.connect(args.target, "opts") end,
        connect_options_unknown = function() return isthmus.connect(args.target, { timeout = 0.1 }) end,
        call_options_unknown = function() return ch:unary(ECHO .. "Unary", "", { raw = true, timeout_ms = 100 }) end,
        -- As many keys as options looked up, one of them through __index: still an unknown one.
        call_options_unknown_beside_inherited = function()
            local opts = setmetatable({ raw = true, timeout_ms = 100 }, { __index = { timeout = 30 } })
            return ch:unary(ECHO .. "Unary", "", opts)
        end,
        call_options_list = function() return ch:unary(ECHO .. "Unary", "", { raw = true, 30 }) end,
        stream_options_unknown = function() return ch:stream(ECHO .. "Bidi", { deadline = 1 }) end,
    }
    local out = {}
    for name, call in pairs(calls) do
        local raised, ok, err = pcall(call)
        if not raised then
            out[name] = "raised: " .. tostring(ok)
        elseif ok then
            out[name] = "succeeded"
        else
            out[name] = failure(err).name
        end
    end
    local ok, reply = ch:unary(ECHO .. "Unary", "\10\3abc", raw)
    out.after = ok and payload_of(reply) or failure(reply).name
    return out
end

function cases.big(ch, args)
    local size = tonumber(args.size)
    local payload = string.rep("0123456789abcdef", size / 16)
    local request = "\10" .. varint(#payload) .. payload
    local ok, reply = ch:unary(ECHO .. "Unary", request, { raw = true, timeout = 60 })
    if not ok then return failure(reply) end
    local echoed = payload_of(reply)
    return { ok = true, size = #echoed, same = echoed == payload }
end

-- A channel of its own whose `max_message_size` is 1 MiB (the limit on what it receives): a
-- 2 MiB request goes, its 2 MiB echo fails RESOURCE_EXHAUSTED, and the next call works.
function cases.limited(_, args)
    local key = args.target .. "#limited"
    local ch = channels[key]
    if not ch then
        ch = assert(isthmus.connect(args.target, { proto = proto, max_message_size = 1048576 }))
        channels[key] = ch
    end
    local payload = string.rep("x", 2097152)
    local ok, err = ch:unary(ECHO .. "Unary", "\10" .. varint(#payload) .. payload, { raw = true, timeout = 60 })
    if ok then
        return { ok = true }
    end
    local after, reply = ch:unary(ECHO .. "Unary", "\10\3abc", { raw = true, timeout = 60 })
    local r = failure(err)
    r.after = after and payload_of(reply) or tostring(reply)
    return r
end

function cases.bad_request(ch, args)
    local ok, err = ch:unary(ECHO .. "Unary", { no_such_field = 1 })
    if ok then return { ok = true } end
    return failure(err)
end

-- Lua tables through a proto loaded from `args.proto` (package demo), each as a Lua user writes
-- it: encoded, then decoded back (doubles as "%.17g" text, to see every digit). With
-- `args.target`, also a reply that does not parse as the type a second proto
-- (`args.strict_proto`) declares for the echo's Unary.
function cases.lua_tables(_, args)
    local p = assert(isthmus.load_proto({ args.proto }))
    -- Another library's setting of the shared lua-cjson must not reach the module's JSON.
    require("cjson.safe").encode_number_precision(4)
    local r = {}
    for name, tbl in pairs({
        top = { pings = {}, by_name = {} },
        nested = { pings = { { labels = {}, attrs = {}, note = "a" } }, first = { labels = {} } },
        double = { first = { d = 0.1 + 0.2 } },
        -- serde_json's own parse read this one a bit off (serde-rs/json#604).
        double_hard = { first = { d = 117.63331139400017 } },
        same_key = { by_int = { [1] = "a", ["1"] = "b" } },
        seq = { first = { seq = 1234567 } },
        special = { pings = { { d = math.huge }, { d = -math.huge }, { d = 0 / 0 } } },
        int_keys = { by_int = { [1] = "a", [2] = "b", [100] = "c" } },
        bool_keys = { by_bool = { [true] = "yes" } },
        cdata = { first = { seq = 1234567890123456789ULL } },
        list_value = { first = { lv = {} } },
    }) do
        local ok, bytes = p:encode("demo.Pong", tbl)
        if not ok then
            r[name] = failure(bytes)
        else
            local decoded_ok, back = p:decode("demo.Pong", bytes)
            if back.first and type(back.first.d) == "number" then
                back.first.d = string.format("%.17g", back.first.d)
            end
            r[name] = { ok = decoded_ok, size = #bytes, back = back }
        end
    end
    require("cjson.safe").encode_number_precision(14)
    local ok, err = p:encode("demo.Pong", { pings = { x = 1 } })
    r.map_for_list = ok and { ok = true } or failure(err)
    r.concat = "failed: " .. err
    if args.target and args.target ~= "" then
        local strict = assert(isthmus.load_proto({ args.strict_proto }))
        local ch = assert(isthmus.connect(args.target, { proto = strict }))
        local cok, reply = ch:unary(ECHO .. "Unary", { payload = ngx.encode_base64("\255\254") }, { timeout = 10 })
        r.unparsable = cok and { ok = true } or failure(reply)
        ch:close()
    end
    return r
end

-- A receive bounded the OpenResty way: in a light thread, killed when a sleep wins.
local function killed_recv(st)
    local th = ngx.thread.spawn(function() return st:recv() end)
    ngx.thread.wait(th, ngx.thread.spawn(function() ngx.sleep(0.05) end))
    assert(ngx.thread.kill(th))
end

-- Receives killed while they wait leave their operations under way; no message is lost, and
-- they come in order. First the echo the left receive gets comes while nobody receives (the
-- watcher's prune, 10 ms or more after the last, finds it finished); then the next receive
-- starts at once, while another light thread sends.
function cases.killed_recv(ch, args)
    local st, err = ch:stream(ECHO .. "Bidi", { timeout = 5 })
    if not st then return failure(err) end
    local seqs = {}
    local function recv()
        local ok, m = st:recv()
        seqs[#seqs + 1] = ok and m and tonumber(m.seq) or (ok and "end" or m.name)
    end
    killed_recv(st)
    assert(st:send({ seq = 1 }))
    -- The worker held (no yield) while the echo comes: the left receive has it before the
    -- watcher runs again, and the watcher's prune then finds that receive finished.
    ngx.update_time()
    local held = ngx.now()
    repeat
        ngx.update_time()
    until ngx.now() - held >= 0.05
    recv()
    killed_recv(st)
    local sender = ngx.thread.spawn(function()
        for i = 2, 4 do
            assert(st:send({ seq = i }))
        end
        return true
    end)
    for _ = 2, 4 do
        recv()
    end
    assert(ngx.thread.wait(sender))
    assert(st:close_send())
    recv()
    st:close()
    return { seqs = seqs }
end

-- A bidi stream whose reply does not parse as the type a proto (`args.strict_proto`)
-- declares: the receive fails, and the call with it (cancelled, as grpc-go's stream ends): the
-- next receive gives the same error at once, and a send fails.
function cases.unparsable_stream(_, args)
    local strict = assert(isthmus.load_proto({ args.strict_proto }))
    local ch = assert(isthmus.connect(args.target, { proto = strict }))
    local st = assert(ch:stream(ECHO .. "Bidi", { timeout = 10 }))
    assert(st:send({ payload = ngx.encode_base64("\255\254"), seq = 1 }))
    local ok, err = st:recv()
    local again_ok, again = st:recv()
    local sent, serr = st:send({ payload = ngx.encode_base64("ok"), seq = 2 })
    st:close()
    ch:close()
    return {
        first = ok and "a message" or failure(err),
        again = again_ok and "a message" or failure(again),
        same = again == err,
        sent = sent and "sent" or serr.name,
    }
end

-- A channel of its own to `target` (`upgrade` "1", "0" or absent), making unary calls until its
-- stats count one over shared memory (it moved to the server's shm:// endpoint) or `seconds`
-- pass: how many its stats counted, and how long it took.
function cases.upgrade(_, args)
    local opts = { proto = proto }
    if args.upgrade then opts.upgrade = args.upgrade == "1" end
    local ch = assert(isthmus.connect(args.target, opts))
    ngx.update_time()
    local began, n = ngx.now(), 0
    while ngx.now() - began < tonumber(args.seconds) do
        local ok, err = ch:unary(ECHO .. "Unary", { payload = ngx.encode_base64("where") }, { timeout = 30 })
        if not ok then ch:close(); return failure(err) end
        n = assert(ch:stats()).calls_started
        if n > 0 then break end
        ngx.sleep(0.005)
        ngx.update_time()
    end
    ch:close()
    return { ok = true, shm_calls = n, took = ngx.now() - began }
end

-- A subscriber of the Go peer's topic: a stream to /topic.Topic/Watch, then publishes through
-- /topic.Topic/Publish (which answers how many it reached) until one reaches it; what the
-- stream then receives.
function cases.topic(ch, args)
    local st, err = ch:stream("/topic.Topic/Watch", { timeout = 30 })
    if not st then return failure(err) end
    assert(st:send("", true))
    local function publish(text)
        local ok, reached = ch:unary("/topic.Topic/Publish", text, { timeout = 30 })
        if not ok then error(tostring(reached)) end
        return tonumber(reached)
    end
    local tries = 0
    while publish("sync") < 1 do
        tries = tries + 1
        if tries > 3000 then st:close(); return { ok = false, message = "never subscribed" } end
        ngx.sleep(0.01)
    end
    assert(publish("a") == 1 and publish("b") == 1)
    local got = {}
    for _ = 1, 3 do
        local ok, m = st:recv()
        if not ok then st:close(); return failure(m) end
        got[#got + 1] = m
    end
    st:cancel()
    st:close()
    return { ok = true, got = got }
end

function cases.stats(ch, args)
    return assert((args.orphan == "1" and orphans[args.target] or ch):stats())
end

function cases.state(ch, args)
    return { state = ch:state(args.connect == "1") }
end

-- Waits for the channel's state to leave `from` (seconds `timeout` at most): the new state, or
-- the error and the state it stayed.
function cases.wait_state(ch, args)
    local ok, r = ch:wait_state(args.from, tonumber(args.timeout))
    if ok then
        return { ok = true, state = r }
    end
    return { ok = false, code = r.code, state = r.state, message = r.message }
end

-- A stream whose deadline passes while it waits: one message echoed, then a recv the server
-- never answers (it waits for the next request).
function cases.stream_deadline(ch, args)
    local st, err = ch:stream(ECHO .. "Bidi", { timeout = tonumber(args.timeout) })
    if not st then return failure(err) end
    assert(st:send({ payload = ngx.encode_base64("ping"), seq = 1 }))
    local ok, m = st:recv()
    if not ok then return failure(m) end
    local started = ngx.now()
    local ok2, err2 = st:recv()
    ngx.update_time()
    local waited = ngx.now() - started
    st:close()
    if ok2 then return { ok = true, first = tonumber(m.seq), after = err2 and "a message" or "the end" } end
    local r = failure(err2)
    r.first, r.waited_ms = tonumber(m.seq), math.floor(waited * 1000)
    return r
end

-- Metadata both ways on a stream: the Unary method driven step by step, with `x-echo`, which
-- the servers reflect into their headers (and, but for tonic-peer, their trailers).
function cases.stream_metadata(ch, args)
    local st, err = ch:stream(ECHO .. "Unary", { timeout = 30, metadata = { ["x-echo"] = "stream-md" } })
    if not st then return failure(err) end
    assert(st:send({ payload = ngx.encode_base64("md"), seq = 11 }, true))
    local hok, headers = st:headers()
    if not hok then return failure(headers) end
    local ok, m = st:recv()
    if not ok then return failure(m) end
    local ok2, after = st:recv()
    if not ok2 then return failure(after) end
    st:close()
    return { ok = true, seq = tonumber(m.seq), payload = ngx.decode_base64(m.payload),
        time_left_ms = tonumber(m.time_left_ms), ended = after == nil,
        header = headers["x-echo"], trailer = st.trailers["x-echo"] }
end

-- A unary call on a channel of its own with TLS settings: `ca`, `cert` and `key` name PEM files,
-- passed as their text (`tls.ca`...) or, with `files=1`, by name (`tls.ca_file`...); `bad_ca` is
-- text given as `tls.ca` in their place, `server_name` goes as it is. Says whether connect
-- failed, and the CN the server saw of the client's certificate (tonic-peer's `x-peer-cn`).
local function read(path)
    local f = assert(io.open(path, "rb"))
    local s = f:read("*a")
    f:close()
    return s
end

function cases.tls_unary(ch, args)
    local tls = { server_name = args.server_name, ca = args.bad_ca }
    for _, name in ipairs({ "ca", "cert", "key" }) do
        local path = args[name]
        if path then
            if args.files == "1" then
                tls[name .. "_file"] = path
            else
                tls[name] = read(path)
            end
        end
    end
    local own, err = isthmus.connect(args.target, { proto = proto, tls = tls })
    if not own then
        local r = failure(err)
        r.connect_failed = true
        return r
    end
    local ok, r, meta = own:unary(ECHO .. "Unary", { payload = ngx.encode_base64("tls"), seq = 21 }, { timeout = 30 })
    own:close()
    if not ok then return failure(r) end
    return { ok = true, payload = ngx.decode_base64(r.payload), seq = r.seq, cn = meta.headers["x-peer-cn"] }
end

-- connect's answer: `{ ok = true }` (the channel closed again) or its error.
local function connect_answer(target, opts)
    local own, err = isthmus.connect(target, opts)
    if own then
        own:close()
        return { ok = true }
    end
    return failure(err)
end

-- connect's answer to TLS options it refuses before any connection: `which` picks them.
function cases.tls_refused(ch, args)
    local tls = ({
        not_a_table = "yes",
        unknown = { cacert = "x" },
        not_a_string = { ca = 1 },
        both = { ca = "x", ca_file = "/nonexistent" },
        missing_file = { ca_file = "/nonexistent/ca.pem" },
        cert_alone = { cert = "x" },
        nul_name = { server_name = "api.internal\0x" },
        nul_file = { ca_file = "/etc/hosts\0x" },
    })[args.which]
    return connect_answer(args.target, { tls = tls })
end

-- connect's answer to a switch (`upgrade`...) that is no boolean: refused, where "no" turned
-- it on.
function cases.switch_refused(ch, args)
    return connect_answer(args.target, { [args.key] = args.value })
end

-- wait_state's answer to a timeout of NaN (which never ended the wait), -1 or math.huge.
function cases.wait_state_refused(ch, args)
    local now = ch:state()
    local last = args.value == "huge" and "SHUTDOWN" or now
    local ok, err = ch:wait_state(last, ({ nan = 0 / 0, negative = -1, huge = math.huge })[args.value])
    if ok then
        return { ok = true, changed = err ~= last }
    end
    local r = failure(err)
    r.kept = err.state == now
    return r
end

-- connect's answer to a numeric option that is no whole number of 0 or more: refused before
-- a channel exists (before, a string spin_us raised in the ffi after the channel was made, and
-- that channel was never closed).
function cases.option_refused(ch, args)
    local value = ({ string = "10", negative = -1, fraction = 1.5, nan = 0 / 0, huge = math.huge })[args.value]
    return connect_answer(args.target, { [args.key] = value })
end

-- connect's authority: what the server saw as a call's `:authority` on a channel that names
-- `args.authority` (none: the target's), over HTTP/2; or connect's refusal of one.
function cases.authority(_, args)
    local own, err = isthmus.connect(args.target, { proto = proto, authority = args.authority, upgrade = false })
    if not own then
        return failure(err)
    end
    local ok, r, meta = own:unary(ECHO .. "Unary", { seq = 1 },
        { timeout = 10, metadata = { ["x-want-authority"] = "1" } })
    own:close()
    if not ok then
        return failure(r)
    end
    return { ok = true, authority = meta.headers["x-authority"] }
end

-- connect's user_agent: a call on a channel that names one, or connect's refusal of a value
-- that is no agent (`args.value` picks it).
function cases.user_agent(_, args)
    local value = ({ good = "lua-test/1.0", number = 5, newline = "a\nb", empty = "", nul = "a\0b" })[args.value]
    local own, err = isthmus.connect(args.target, { proto = proto, user_agent = value })
    if not own then
        return failure(err)
    end
    local ok, r = own:unary(ECHO .. "Unary", { payload = ngx.encode_base64("agent"), seq = 1 }, { timeout = 10 })
    own:close()
    if not ok then
        return failure(r)
    end
    return { ok = true, payload = ngx.decode_base64(r.payload) }
end

-- One channel per target with a quick keepalive (a PING after 200 ms of quiet, 500 ms for its
-- answer), kept on HTTP/2.
local keepalive_channels = {}

-- A raw unary call of `args.path` with `args.body` on the target's keepalive channel, and a
-- deadline a minute away.
function cases.keepalive(ch, args)
    local kch = keepalive_channels[args.target]
    if not kch then
        kch = assert(isthmus.connect(args.target,
            { keepalive_time_ms = 200, keepalive_timeout_ms = 500, upgrade = false }))
        keepalive_channels[args.target] = kch
    end
    local ok, r = kch:unary(args.path, args.body or "", { raw = true, timeout = 60 })
    if not ok then return failure(r) end
    return { ok = true, reply = r }
end

-- A raw unary call, with a deadline a minute away, on a channel to `args.target` whose
-- connections must come up within `args.ms` milliseconds; and how long it took.
function cases.connect_timeout(_, args)
    local ch = assert(isthmus.connect(args.target, { connect_timeout_ms = tonumber(args.ms), upgrade = false }))
    local began = ngx.now()
    local ok, r = ch:unary("/any.S/M", "", { raw = true, timeout = 60 })
    ngx.update_time()
    local took = ngx.now() - began
    ch:close()
    if not ok then
        local f = failure(r)
        f.took = took
        return f
    end
    return { ok = true, took = took }
end

-- Runs case `args.run` in a timer (ngx.timer.at); its result lands in the shared dict under
-- `args.id`, which timer_result reads.
function cases.timer_start(ch, args)
    local ok, err = ngx.timer.at(0, function(premature)
        local r
        if premature then
            r = { ok = false, message = "premature" }
        else
            r = cases[args.run](ch, args)
            r.phase = ngx.get_phase()
        end
        ngx.shared.isthmus_tests:set(args.id, cjson.encode(r))
    end)
    return { started = ok and true or false, err = err }
end

-- Starts `n` timers that each sleep `ms` milliseconds: they hold that many of the worker's
-- running timers (lua_max_running_timers) meanwhile.
function cases.hog_timers(_, args)
    local started = 0
    for _ = 1, tonumber(args.n) do
        if ngx.timer.at(0, function() ngx.sleep(tonumber(args.ms) / 1000) end) then
            started = started + 1
        end
    end
    return { started = started }
end

function cases.timer_result(ch, args)
    local r = ngx.shared.isthmus_tests:get(args.id)
    return r and cjson.decode(r) or { pending = true }
end

function cases.init_result(ch, args)
    return init_results or { none = true }
end

-- Sends `message` on `st` `n` times in a light thread, and returns once the sends stop (no
-- progress for half a second while the server is stopped) or all went: the thread, and a
-- function that says how many went.
local function send_until_stalled(st, message, n)
    local sent = 0
    local th = ngx.thread.spawn(function()
        for i = 1, n do
            local ok, err = st:send(message)
            if not ok then return false, err end
            sent = i
        end
        return true
    end)
    local last, still = -1, 0
    while sent < n and still < 10 do
        ngx.sleep(0.05)
        if sent == last then
            still = still + 1
        else
            last, still = sent, 0
        end
    end
    return th, function() return sent end
end

-- Ends a stream whose sends went on after the server read again: its echoes, and the end.
local function drain(th, st)
    local wok, ok, err = ngx.thread.wait(th)
    if not (wok and ok) then return nil, err end
    local cok, cerr = st:close_send()
    if not cok then return nil, cerr end
    local echoed = 0
    while true do
        local rok, m = st:recv()
        if not rok then return nil, m end
        if m == nil then break end
        echoed = echoed + 1
    end
    st:close()
    return echoed
end

-- close_send while the server's ring is full (the test stopped the server with SIGSTOP after
-- the channel connected): one stream sends large messages until one no longer fits, a second
-- fills what is left with empty ones (each as large in the ring as a half-close); then a third
-- stream half-closes, which must wait by yielding, not by blocking the worker. The file
-- `args.flag` tells the test that close_send is about to wait; the test then checks that the
-- worker answers other requests, and lets the server go on.
function cases.close_send_full_ring(ch, args)
    local n, size = tonumber(args.n), tonumber(args.size)
    local streams = {}
    for i = 1, 3 do
        local st, err = ch:stream(ECHO .. "Bidi", { timeout = 30 })
        if not st then return failure(err) end
        streams[i] = st
    end
    local big, small = streams[1], streams[2]
    local ok, bytes = proto:encode("conformance.EchoRequest", { payload = ngx.encode_base64(string.rep("x", size)), seq = 1 })
    assert(ok, tostring(bytes))
    local big_th, big_sent = send_until_stalled(big, bytes, n)
    local small_th, small_sent = send_until_stalled(small, "", n)
    local stalled_big, stalled_small = big_sent(), small_sent()
    if stalled_big >= n or stalled_small >= n then
        for _, st in ipairs(streams) do st:close() end
        return { ok = false, message = ("the ring never filled: %d and %d messages went"):format(stalled_big, stalled_small) }
    end
    local f = assert(io.open(args.flag, "w"))
    f:write(stalled_big, " ", stalled_small)
    f:close()
    local cok, cerr = streams[3]:close_send()
    if not cok then return failure(cerr) end
    -- The server runs again: everything sent arrives, and each stream ends.
    local rok, m = streams[3]:recv()
    if not rok then return failure(m) end
    streams[3]:close()
    local echoed_big, berr = drain(big_th, big)
    if not echoed_big then return failure(berr) end
    local echoed_small, serr = drain(small_th, small)
    if not echoed_small then return failure(serr) end
    return { ok = true, stalled_big = stalled_big, stalled_small = stalled_small, ended = m == nil,
        echoed = { echoed_big, echoed_small } }
end

-- LuaJIT's trace events in the module while requests each make one call (jit_one), as under
-- load: the traces compiled there, and the aborts that leave a path interpreted for good (an
-- inner loop, blacklisting). Watching starts afresh, or with `stop` ends and answers what was
-- seen. An inner loop on a call's path that never turns (the wait's, once) made LuaJIT give up
-- on every trace through it until it blacklisted the path, which then ran interpreted: about
-- 2 µs more per call under wrk (docs/adr/0011).
local jit_seen, jit_compiled = {}, 0
local jutil, vmdef -- loaded outside the callback, whose errors LuaJIT only prints
local function on_trace(what, _, func, pc, otr, oex)
    -- Requests' traces only: the watcher's (a timer) runs once per bell, not per call.
    if (what ~= "abort" and what ~= "stop") or ngx.get_phase() == "timer" then
        return
    end
    if what == "stop" then
        -- Any request's trace: which function a trace through the call starts in (the case's,
        -- nginx's, the module's) is up to LuaJIT's hot counters, so counting the module's only
        -- saw none in some runs.
        jit_compiled = jit_compiled + 1
        return
    end
    local where = jutil.funcinfo(func, pc)
    if not (where.source and where.source:find("resty/isthmus.lua", 1, true)) then
        return
    end
    local why = type(otr) == "number" and vmdef.traceerr[otr]:format(tostring(oex)) or tostring(otr)
    if why:find("inner loop", 1, true) or why:find("blacklisted", 1, true) then
        local key = tostring(where.loc) .. ": " .. why
        jit_seen[key] = (jit_seen[key] or 0) + 1
    end
end

function cases.jit_watch(_, args)
    if args.stop then
        jit.attach(on_trace)
        return { ok = true, aborts = jit_seen, compiled = jit_compiled, jit = jit.status() }
    end
    jutil, vmdef = require("jit.util"), require("jit.vmdef")
    jit_seen, jit_compiled = {}, 0
    -- The call's path compiles anew under the watch: traces the worker's earlier requests had
    -- compiled already left nothing to see (no trace stopped, and `compiled` stayed 0).
    jit.flush()
    jit.attach(on_trace, "trace")
    return { ok = true }
end

function cases.jit_one(_, args)
    local key = args.target .. "#nospin"
    local ch = channels[key]
    if not ch then
        ch = assert(isthmus.connect(args.target, { spin = false }))
        channels[key] = ch
    end
    -- EchoRequest{payload: "jit"}, with an option if asked.
    local ok, r = ch:unary(ECHO .. "Unary", "\10\3jit", args.timeout and { timeout = 30 } or nil)
    if not ok then return failure(r) end
    return { ok = true }
end

-- Who a call is taken to come from (the spin rule's caller, docs/adr/0011) and the coroutine
-- this request runs on, each against the last request's that ran this case.
local last_co, last_caller
function cases.caller(_, args)
    local phase = ngx.get_phase()
    local co, who = coroutine.running(), isthmus._caller(phase)
    local r = { ok = true, same_coroutine = co == last_co, same_caller = who == last_caller,
        steady = isthmus._caller(phase) == who }
    last_co, last_caller = co, who
    return r
end

function _M.serve()
    local name = ngx.var.uri:match("^/case/([%w_]+)$")
    local case = cases[name]
    if not case then
        return ngx.exit(404)
    end
    local args = ngx.req.get_uri_args()
    local target = args.target
    ngx.say(cjson.encode(case(target ~= "" and channel(target) or nil, args)))
end

-- A call in the access phase: its answer is what the content phase says.
function _M.access()
    local ch = channel(ngx.req.get_uri_args().target)
    local ok, r = ch:unary(ECHO .. "Unary", { payload = ngx.encode_base64("access"), seq = 9 })
    ngx.ctx.answer = ok and ngx.decode_base64(r.payload) or tostring(r)
end

return _M
