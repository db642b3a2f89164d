-- The Lua side of lua/tests: each case makes real calls through resty.isthmus from inside an
-- nginx worker (GET /case/<name>?target=...&...) and answers with what it saw, as JSON, for
-- test_nginx.py to check. The channels are the worker's, one per target, shared by requests.

local isthmus = require "resty.isthmus"
local cjson = require "cjson.safe"

local _M = {}

local proto
local channels = {}

local ECHO = "/conformance.Echo/"

function _M.init_worker(proto_path)
    proto = assert(isthmus.load_proto({ proto_path }))
end

local function channel(target)
    local ch = channels[target]
    if not ch then
        ch = assert(isthmus.connect(target, { proto = proto }))
        channels[target] = ch
    end
    return ch
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

local cases = {}

function cases.unary(ch, args)
    local ok, r, meta = ch:unary(ECHO .. "Unary", { payload = ngx.encode_base64("hello"), seq = 7 },
        { timeout = 30, metadata = { ["x-echo"] = "from-lua" } })
    if not ok then return failure(r) end
    return { ok = true, payload = ngx.decode_base64(r.payload), seq = r.seq, time_left_ms = r.time_left_ms,
        header = meta.headers["x-echo"], trailer = meta.trailers["x-echo"] }
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

function cases.fail(ch, args)
    local ok, err = ch:unary(ECHO .. "Unary", { fail_with = tonumber(args.code), fail_message = args.message })
    if ok then return { ok = true } end
    return failure(err)
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

function cases.big(ch, args)
    local size = tonumber(args.size)
    local payload = string.rep("0123456789abcdef", size / 16)
    local request = "\10" .. varint(#payload) .. payload
    local ok, reply = ch:unary(ECHO .. "Unary", request, { raw = true, timeout = 60 })
    if not ok then return failure(reply) end
    local echoed = payload_of(reply)
    return { ok = true, size = #echoed, same = echoed == payload }
end

function cases.bad_request(ch, args)
    local ok, err = ch:unary(ECHO .. "Unary", { no_such_field = 1 })
    if ok then return { ok = true } end
    return failure(err)
end

function cases.state(ch, args)
    return { state = ch:state(args.connect == "1") }
end

function _M.serve()
    local name = ngx.var.uri:match("^/case/([%w_]+)$")
    local case = cases[name]
    if not case then
        return ngx.exit(404)
    end
    local args = ngx.req.get_uri_args()
    ngx.say(cjson.encode(case(channel(args.target), args)))
end

-- A call in the access phase: its answer is what the content phase says.
function _M.access()
    local ch = channel(ngx.req.get_uri_args().target)
    local ok, r = ch:unary(ECHO .. "Unary", { payload = ngx.encode_base64("access"), seq = 9 })
    ngx.ctx.answer = ok and ngx.decode_base64(r.payload) or tostring(r)
end

return _M
