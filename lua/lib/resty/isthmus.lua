-- resty.isthmus: gRPC calls from LuaJIT and nginx (OpenResty, or Debian's nginx with its Lua
-- module) through isthmus: shared memory to a server on the same machine (shm://), standard
-- gRPC over HTTP/2 beyond it (unix://, http://, https://). It stands on the C ABI
-- (libisthmus_capi, crates/isthmus-capi) through LuaJIT's ffi.
--
-- Inside nginx a call never blocks the worker: it is started without blocking, waits a few
-- microseconds for a fast reply, and otherwise yields on an ngx.semaphore; one timer per worker
-- watches the completion queue through a cosocket the library rings (docs/adr/0011). Outside
-- nginx, and in nginx phases that cannot yield (init_worker_by_lua, set_by_lua, log_by_lua...),
-- the same calls block: in nginx, for 60 s at most unless they say (`init`'s blocking_timeout).
--
--   local isthmus = require "resty.isthmus"
--   local ch = assert(isthmus.connect("shm://sidecar", { proto = isthmus.load_proto({ "hello.proto" }) }))
--   local ok, reply = ch:unary("/helloworld.Greeter/SayHello", { name = "you" }, { timeout = 1 })
--
-- Every call returns `ok, result_or_err`: on failure `err` is an error table with the gRPC
-- `code` (a number), its `name` ("UNAVAILABLE"), `message`, `headers` (the initial metadata
-- the server sent before a unary call failed, else empty), `trailers` and `details` (the
-- status's details as the server sent them, or nil).

local ffi = require "ffi"
local bor, band = require("bit").bor, require("bit").band

local C
local ffi_new, ffi_string, ffi_gc = ffi.new, ffi.string, ffi.gc
local tonumber, type, setmetatable, pairs, ipairs, error, next = tonumber, type, setmetatable, pairs, ipairs, error, next

local ngx = ngx -- nil outside nginx

local _M = { _VERSION = "0.1.0" }

-- The part of include/isthmus.h this module uses (ffi.cdef takes no #define or #include). A
-- test (lua/tests) checks every declaration here against the header.
ffi.cdef [[
typedef int32_t isthmus_code_t;
typedef int32_t isthmus_op_t;
typedef struct isthmus_block_t isthmus_block_t;
typedef struct isthmus_call_t isthmus_call_t;
typedef struct isthmus_channel_t isthmus_channel_t;
typedef struct isthmus_cq_t isthmus_cq_t;
typedef struct isthmus_message_t isthmus_message_t;
typedef struct isthmus_metadata_t isthmus_metadata_t;
typedef struct isthmus_proto_t isthmus_proto_t;
typedef struct isthmus_server_call_t isthmus_server_call_t;
typedef struct isthmus_status_t isthmus_status_t;
typedef struct {
  const char *root_certs_pem;
  const char *cert_chain_pem;
  const char *private_key_pem;
  const char *server_name;
  uint32_t require_client_cert;
} isthmus_tls_options_t;
typedef struct {
  uint64_t max_message_size;
  const isthmus_tls_options_t *tls;
  uint32_t flags;
  uint64_t keepalive_time_ms;
  uint64_t keepalive_timeout_ms;
  const char *user_agent;
  const char *authority;
  uint64_t connect_timeout_ms;
} isthmus_channel_options_t;
typedef struct {
  int64_t timeout_us;
  const isthmus_metadata_t *metadata;
  uint32_t flags;
} isthmus_call_options_t;
typedef struct {
  uint64_t tag;
  isthmus_op_t op;
  isthmus_code_t code;
  isthmus_call_t *call;
  isthmus_server_call_t *server_call;
  isthmus_message_t *message;
  const uint8_t *message_data;
  size_t message_len;
  isthmus_metadata_t *metadata;
  isthmus_metadata_t *trailers;
  isthmus_status_t *status;
} isthmus_event_t;
typedef struct {
  uint64_t calls_started;
  uint64_t calls_in_flight;
  uint64_t calls_finished[17];
  uint64_t frames_sent;
  uint64_t frames_received;
  uint64_t bytes_sent;
  uint64_t bytes_received;
  uint64_t doorbells_rung;
  uint64_t sleeps;
  uint64_t spin_hits;
  uint64_t ring_full_waits;
  uint64_t arena_full_waits;
  uint64_t arena_in_use;
  uint64_t arena_high_water;
  uint64_t shared_sent;
  uint64_t answers_dropped;
} isthmus_stats_t;

uint32_t isthmus_abi_version(void);
int64_t isthmus_clock_us(void);
const char *isthmus_code_name(isthmus_code_t code);
isthmus_code_t isthmus_status_code(const isthmus_status_t *status);
const char *isthmus_status_message(const isthmus_status_t *status);
isthmus_code_t isthmus_status_free(isthmus_status_t *status);
isthmus_metadata_t *isthmus_status_trailers(const isthmus_status_t *status);
const uint8_t *isthmus_status_details(const isthmus_status_t *status, size_t *len);
isthmus_code_t isthmus_channel_new(const char *target, const isthmus_channel_options_t *opts, isthmus_channel_t **out, isthmus_status_t **status);
isthmus_code_t isthmus_channel_close(isthmus_channel_t *channel);
isthmus_code_t isthmus_channel_set_spin(const isthmus_channel_t *channel, uint32_t spin_us);
isthmus_code_t isthmus_channel_state(const isthmus_channel_t *channel, int32_t try_to_connect, uint32_t *state);
isthmus_code_t isthmus_channel_wait_state(const isthmus_channel_t *channel, uint32_t last, uint32_t timeout_ms, uint32_t *state);
isthmus_code_t isthmus_channel_wait_state_async(const isthmus_channel_t *channel, uint32_t last, int64_t timeout_ms, const isthmus_cq_t *cq, uint64_t tag, isthmus_event_t *now, isthmus_status_t **status);
isthmus_code_t isthmus_channel_stats(const isthmus_channel_t *channel, isthmus_stats_t *out, size_t size);
isthmus_code_t isthmus_unary(const isthmus_channel_t *channel, const char *path, const uint8_t *request, size_t request_len, const isthmus_call_options_t *opts, isthmus_message_t **reply, isthmus_metadata_t **headers, isthmus_metadata_t **trailers, isthmus_status_t **status);
isthmus_code_t isthmus_unary_async(const isthmus_channel_t *channel, const char *path, const uint8_t *request, size_t request_len, const isthmus_call_options_t *opts, const isthmus_cq_t *cq, uint64_t tag, isthmus_event_t *now, isthmus_status_t **status);
isthmus_code_t isthmus_call_start(const isthmus_channel_t *channel, const char *path, const isthmus_call_options_t *opts, isthmus_call_t **call, isthmus_status_t **status);
isthmus_code_t isthmus_call_start_async(const isthmus_channel_t *channel, const char *path, const isthmus_call_options_t *opts, const isthmus_cq_t *cq, uint64_t tag, isthmus_event_t *now, isthmus_status_t **status);
isthmus_code_t isthmus_call_send(const isthmus_call_t *call, const uint8_t *data, size_t len, int32_t last, isthmus_status_t **status);
isthmus_code_t isthmus_call_send_async(const isthmus_call_t *call, const uint8_t *data, size_t len, int32_t last, const isthmus_cq_t *cq, uint64_t tag, isthmus_event_t *now, isthmus_status_t **status);
isthmus_code_t isthmus_call_close_send(const isthmus_call_t *call);
isthmus_code_t isthmus_call_close_send_async(const isthmus_call_t *call, const isthmus_cq_t *cq, uint64_t tag, isthmus_event_t *now, isthmus_status_t **status);
isthmus_code_t isthmus_call_recv(const isthmus_call_t *call, isthmus_message_t **message, isthmus_status_t **status);
isthmus_code_t isthmus_call_recv_async(const isthmus_call_t *call, const isthmus_cq_t *cq, uint64_t tag, isthmus_event_t *now, isthmus_status_t **status);
isthmus_code_t isthmus_call_headers(const isthmus_call_t *call, isthmus_metadata_t **headers, isthmus_status_t **status);
isthmus_code_t isthmus_call_headers_async(const isthmus_call_t *call, const isthmus_cq_t *cq, uint64_t tag, isthmus_event_t *now, isthmus_status_t **status);
isthmus_metadata_t *isthmus_call_trailers(const isthmus_call_t *call);
isthmus_code_t isthmus_call_cancel(const isthmus_call_t *call);
isthmus_code_t isthmus_call_free(isthmus_call_t *call);
isthmus_cq_t *isthmus_cq_new(void);
int32_t isthmus_cq_fd(const isthmus_cq_t *cq);
isthmus_code_t isthmus_cq_free(isthmus_cq_t *cq);
size_t isthmus_cq_poll(const isthmus_cq_t *cq, isthmus_event_t *events, size_t capacity);
size_t isthmus_cq_wait(const isthmus_cq_t *cq, isthmus_event_t *events, size_t capacity, uint32_t spin_us, int64_t timeout_us);
isthmus_code_t isthmus_cq_cancel(const isthmus_cq_t *cq, uint64_t tag);
isthmus_code_t isthmus_cq_wake(const isthmus_cq_t *cq);
isthmus_code_t isthmus_cq_bell_listen(const isthmus_cq_t *cq, char *path, size_t capacity, isthmus_status_t **status);
isthmus_code_t isthmus_cq_bell_accept(const isthmus_cq_t *cq, isthmus_status_t **status);
const uint8_t *isthmus_message_data(const isthmus_message_t *msg, size_t *len);
isthmus_code_t isthmus_message_free(isthmus_message_t *msg);
isthmus_metadata_t *isthmus_metadata_new(void);
isthmus_code_t isthmus_metadata_add(isthmus_metadata_t *md, const char *key, const uint8_t *value, size_t value_len, isthmus_status_t **status);
size_t isthmus_metadata_len(const isthmus_metadata_t *md);
isthmus_code_t isthmus_metadata_get(const isthmus_metadata_t *md, size_t index, const uint8_t **key, size_t *key_len, const uint8_t **value, size_t *value_len);
isthmus_code_t isthmus_metadata_free(isthmus_metadata_t *md);
isthmus_code_t isthmus_proto_load(const char *const *files, size_t nfiles, const char *const *includes, size_t nincludes, isthmus_proto_t **out, isthmus_status_t **status);
isthmus_code_t isthmus_proto_load_descriptor_set(const uint8_t *data, size_t len, isthmus_proto_t **out, isthmus_status_t **status);
const char *isthmus_proto_method_type(const isthmus_proto_t *proto, const char *path, int32_t which);
int32_t isthmus_proto_method_streams(const isthmus_proto_t *proto, const char *path);
isthmus_code_t isthmus_proto_encode(const isthmus_proto_t *proto, const char *type_name, const uint8_t *json, size_t json_len, isthmus_message_t **out, isthmus_status_t **status);
isthmus_code_t isthmus_proto_decode(const isthmus_proto_t *proto, const char *type_name, const uint8_t *data, size_t len, isthmus_message_t **out, isthmus_status_t **status);
isthmus_code_t isthmus_proto_free(isthmus_proto_t *proto);
]]

-- The header's constants this module uses.
local ABI_VERSION = 1
local OK, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, INTERNAL, UNAVAILABLE = 0, 2, 3, 4, 8, 13, 14
local NOT_FOUND, FAILED_PRECONDITION, CANCELLED = 5, 9, 1
local CALL_SPIN = 2
local OP_STATE = 10
local CHANNEL_UPGRADE, CHANNEL_NO_UPGRADE, CHANNEL_KEEPALIVE_WITHOUT_CALLS = 1, 2, 4
local PROTO_REQUEST, PROTO_RESPONSE = 0, 1
local PROTO_CLIENT_STREAMING = 1
local STATES = { [0] = "IDLE", "CONNECTING", "READY", "TRANSIENT_FAILURE", "SHUTDOWN" }

--- The gRPC status codes by name (`isthmus.code.UNAVAILABLE == 14`).
_M.code = {
    OK = 0, CANCELLED = 1, UNKNOWN = 2, INVALID_ARGUMENT = 3, DEADLINE_EXCEEDED = 4,
    NOT_FOUND = 5, ALREADY_EXISTS = 6, PERMISSION_DENIED = 7, RESOURCE_EXHAUSTED = 8,
    FAILED_PRECONDITION = 9, ABORTED = 10, OUT_OF_RANGE = 11, UNIMPLEMENTED = 12,
    INTERNAL = 13, UNAVAILABLE = 14, DATA_LOSS = 15, UNAUTHENTICATED = 16,
}
-- Code -> name, without the library: an error made before it loads has its name too.
local CODE_NAMES = {}
for name, code in pairs(_M.code) do CODE_NAMES[code] = name end

---------------------------------------------------------------------------------------------
-- Loading the library
---------------------------------------------------------------------------------------------

-- Where the library is looked for, first found wins: the path given to isthmus.init{lib=...},
-- $ISTHMUS_LIB (nginx passes it only with `env ISTHMUS_LIB;`), libisthmus_capi.so beside
-- package.cpath's entries, then the system's library path.
local function find_library(explicit)
    if explicit then
        return explicit
    end
    local env = os.getenv("ISTHMUS_LIB")
    if env and env ~= "" then
        return env
    end
    for entry in package.cpath:gmatch("[^;]+") do
        local candidate = entry:gsub("%?", "libisthmus_capi")
        local f = io.open(candidate, "rb")
        if f then
            f:close()
            return candidate
        end
    end
    return "isthmus_capi"
end

-- The C library, loaded on first use: C, or nil and why not (each caller says it its way).
local function load(path)
    if C then
        return C
    end
    local name = find_library(path)
    local ok, lib = pcall(ffi.load, name)
    if not ok then
        return nil, "resty.isthmus: cannot load the isthmus C library (" .. name .. "): " .. tostring(lib)
            .. "; set ISTHMUS_LIB or call isthmus.init{ lib = '/path/to/libisthmus_capi.so' }"
    end
    local version = lib.isthmus_abi_version()
    if version ~= ABI_VERSION then
        return nil, ("resty.isthmus: %s has ABI version %d, this module speaks %d"):format(name, version, ABI_VERSION)
    end
    C = lib
    return C
end

-- Phases in which a coroutine may yield on a semaphore (others block instead). Yielding in an
-- `ssl_*` phase hands OpenSSL a "retry" that only an nginx core with OpenResty's patch for that
-- callback can resume: Debian's nginx carries the one for `ssl_certificate_by_lua`
-- (ssl_cert_cb_yield) and not those for `ssl_client_hello_by_lua` and
-- `ssl_session_fetch_by_lua`, where a yield fails the TLS handshake. Those two block unless
-- `init{ ssl_yield = true }` says the core has their patches (OpenResty's own builds).
local YIELDABLE = { rewrite = true, server_rewrite = true, access = true, content = true, timer = true,
    ssl_cert = true, preread = true }

-- The deadline, in seconds, of a call or wait that blocks the worker (a phase that cannot
-- yield) and whose options name none: as a cosocket's default timeouts, no wait of the worker
-- is unbounded (a server that hangs would hang it). `init{ blocking_timeout = s }` sets it.
local blocking_timeout = 60

--- Loads the C library from `opts.lib` (a path) now instead of on first use, and sets
--- `opts.blocking_timeout`, the deadline in seconds of a call that blocks an nginx worker
--- (made in a phase that cannot yield) and names none (default 60; `math.huge` for none).
--- `opts.ssl_yield = true` lets calls yield in `ssl_client_hello_by_lua` and
--- `ssl_session_fetch_by_lua` too, on an nginx core patched for it (OpenResty's builds; not
--- Debian's, where they block). Returns true.
function _M.init(opts)
    local yield, t = opts and opts.ssl_yield, opts and opts.blocking_timeout
    -- Every option is checked before any takes effect: a refused call changes nothing.
    if yield ~= nil and type(yield) ~= "boolean" then
        error("resty.isthmus: ssl_yield is true or false, not " .. tostring(yield), 2)
    end
    if t ~= nil and (type(t) ~= "number" or t ~= t or t <= 0) then
        error("resty.isthmus: blocking_timeout is a number of seconds above 0, not " .. tostring(t), 2)
    end
    if yield ~= nil then
        YIELDABLE.ssl_client_hello = yield or nil
        YIELDABLE.ssl_session_fetch = yield or nil
    end
    if t ~= nil then
        blocking_timeout = t
    end
    local _, lerr = load(opts and opts.lib)
    if lerr then
        error(lerr, 2) -- set-up, as a bad option is
    end
    return true
end

---------------------------------------------------------------------------------------------
-- Errors, metadata and messages across the boundary
---------------------------------------------------------------------------------------------

local status_out = ffi_new("isthmus_status_t*[1]")
local md_key = ffi_new("const uint8_t*[1]")
local md_key_len = ffi_new("size_t[1]")
local md_val = ffi_new("const uint8_t*[1]")
local md_val_len = ffi_new("size_t[1]")
local details_len = ffi_new("size_t[1]")

-- An error's fields (`code`, `name`, `message`, ...) live beside it, in its own metatable's
-- `__index`, and the table itself holds only its text, at [1]: ngx.say and ngx.print take a
-- table as a list of strings, so `ngx.say("failed: ", err)`, the lua-resty idiom, prints the
-- text (it raised "non-array table found" while the fields were the table's own).
local function error_text(f)
    return tostring(f.name) .. ": " .. tostring(f.message)
end

-- The text the table keeps at [1] (`__newindex` keeps it current).
local function error_tostring(e)
    return rawget(e, 1)
end

local function is_error(v)
    local mt = getmetatable(v)
    return type(mt) == "table" and rawget(mt, "__tostring") == error_tostring
end

-- `"failed: " .. err` reads as tostring(err) does (lua-resty code concatenates its errors).
local function error_concat(a, b)
    return (is_error(a) and error_tostring(a) or a) .. (is_error(b) and error_tostring(b) or b)
end

-- `details`: the status's binary details (a serialized google.rpc.Status, gRPC's
-- grpc-status-details-bin), or nil.
local function new_error(code, message, trailers, details)
    local f = {
        code = code,
        name = CODE_NAMES[code] or (C and ffi_string(C.isthmus_code_name(code))) or "UNKNOWN",
        message = message,
        headers = {},
        trailers = trailers or {},
        details = details,
    }
    return setmetatable({ error_text(f) }, {
        __index = f,
        __newindex = function(e, k, v)
            f[k] = v
            if k == "name" or k == "message" then
                rawset(e, 1, error_text(f))
            end
        end,
        __tostring = error_tostring,
        __concat = error_concat,
    })
end
_M.new_error = new_error

-- Why the C library cannot be used, as an error for `nil, err`, or nil once it is loaded. (A
-- proto needs no lua-cjson until a reply is read as a table.)
local function load_error(lib)
    local _, lerr = load(lib)
    if lerr then
        return new_error(FAILED_PRECONDITION, lerr)
    end
end

-- A metadata handle as a Lua table (key -> value; a key given more than once -> a list of
-- values); frees the handle.
local function take_metadata(md)
    local t = {}
    if md == nil then
        return t
    end
    for i = 0, tonumber(C.isthmus_metadata_len(md)) - 1 do
        if C.isthmus_metadata_get(md, i, md_key, md_key_len, md_val, md_val_len) == OK then
            local k = ffi_string(md_key[0], md_key_len[0])
            local v = ffi_string(md_val[0], md_val_len[0])
            local prev = t[k]
            if prev == nil then
                t[k] = v
            elseif type(prev) == "table" then
                prev[#prev + 1] = v
            else
                t[k] = { prev, v }
            end
        end
    end
    C.isthmus_metadata_free(md)
    return t
end

-- A status handle as an error table; frees the handle.
local function take_status(st, code)
    if st == nil then
        return new_error(code ~= OK and code or UNKNOWN, "the call failed")
    end
    local details = C.isthmus_status_details(st, details_len)
    local err = new_error(C.isthmus_status_code(st), ffi_string(C.isthmus_status_message(st)),
        take_metadata(C.isthmus_status_trailers(st)), details ~= nil and ffi_string(details, details_len[0]) or nil)
    C.isthmus_status_free(st)
    return err
end

-- The error of a function that returned `code`, with the status it stored.
local function failed(code)
    local st = status_out[0]
    status_out[0] = nil
    return take_status(st, code)
end

-- The longest string LuaJIT makes (LJ_MAX_STR): ffi.string raises past it.
local MAX_STRING = 0x7fffff00

-- A message's `len` bytes at `data` as a Lua string, or nil and RESOURCE_EXHAUSTED for one
-- longer than a Lua string can be (the library's limit is 4 GiB).
local function message_string(data, len)
    len = tonumber(len)
    if len > MAX_STRING then
        return nil, new_error(RESOURCE_EXHAUSTED,
            ("a message of %.0f bytes is longer than a Lua string can be (%d bytes)"):format(len, MAX_STRING))
    end
    return ffi_string(data, len)
end

-- A message handle as a Lua string, or nil and an error for one too long to be one; frees the
-- handle either way.
local len_out = ffi_new("size_t[1]")
local function take_message(msg)
    if msg == nil then
        return nil
    end
    local s, err = message_string(C.isthmus_message_data(msg, len_out), len_out[0])
    C.isthmus_message_free(msg)
    return s, err
end

-- A string the library takes as a C string (a path, a metadata key): nil and an error for
-- one that is not a string, or holds a NUL, where C would read it cut short.
local function c_string(what, s)
    if type(s) ~= "string" then
        return nil, new_error(INVALID_ARGUMENT, ("%s is a string, not a %s"):format(what, type(s)))
    end
    if s:find("\0", 1, true) then
        return nil, new_error(INVALID_ARGUMENT, ("%s %q holds a NUL"):format(what, s))
    end
    return s
end

-- A metadata value as text: a whole number in full (`tostring` gives 14 significant digits,
-- and sent 123456789012345 as "1.2345678901235e+14"), anything else as `tostring` writes it.
local function number_text(value)
    if type(value) == "number" and value == math.floor(value) and math.abs(value) < 2 ^ 63 then
        return ("%d"):format(value)
    end
    return tostring(value)
end

-- Lua metadata ({key = value or {values}}) as a handle for one call, or nil. A value is a
-- string (or a number, written as Lua writes it); anything else is refused, not sent as
-- something else (a list's keys were its indexes, a key with a NUL was cut at it, values past
-- a hole were dropped).
local function make_metadata(t)
    if t ~= nil and type(t) ~= "table" then
        return nil, new_error(INVALID_ARGUMENT, "metadata is a table of key = value or {values}, not a " .. type(t))
    end
    if t == nil or next(t) == nil then
        return nil
    end
    local md = ffi_gc(C.isthmus_metadata_new(), C.isthmus_metadata_free)
    for k, v in pairs(t) do
        local key, err = c_string("a metadata key", k)
        if not key then
            return nil, err
        end
        local values = v
        if type(v) == "table" then
            -- A list, 1..n with no hole (an empty one sends nothing): other keys would be lost.
            local n = 0
            for _ in pairs(v) do
                n = n + 1
            end
            for i in pairs(v) do
                if type(i) ~= "number" or i < 1 or i > n or i ~= math.floor(i) then
                    return nil, new_error(INVALID_ARGUMENT,
                        ("metadata values of %s are a list {v1, v2, ...}, with no hole and no other key"):format(key))
                end
            end
        else
            values = { v }
        end
        for _, value in ipairs(values) do
            local kind = type(value)
            if kind ~= "string" and kind ~= "number" then
                return nil, new_error(INVALID_ARGUMENT,
                    ("metadata value of %s is a string or a number, not a %s"):format(key, kind))
            end
            value = number_text(value)
            local rc = C.isthmus_metadata_add(md, key, value, #value, status_out)
            if rc ~= OK then
                return nil, failed(rc)
            end
        end
    end
    return md
end

-- Frees a handle of make_metadata once the call that took it has copied it.
local function free_metadata(md)
    if md ~= nil then
        C.isthmus_metadata_free(ffi_gc(md, nil))
    end
end

---------------------------------------------------------------------------------------------
-- Protobuf through the proto3 JSON mapping
---------------------------------------------------------------------------------------------

-- Replies are read with a lua-cjson instance of this module's own (`cjson.safe.new`), so that
-- another library's settings (`encode_number_precision`...) and this module's never meet.
local cjson
local function json()
    if not cjson then
        local ok, lib = pcall(require, "cjson.safe")
        if not ok then
            return nil, "resty.isthmus: Lua tables as messages need lua-cjson (Debian: apt-get install lua-cjson)"
        end
        cjson = lib.new and lib.new() or lib
    end
    return cjson
end

-- Tables are written as JSON here, not by lua-cjson, whose numbers keep at most 14 digits
-- (16 in OpenResty's build; a double needs 17), which refuses NaN, infinities, boolean keys,
-- 64-bit cdata and sparse arrays, and whose settings are shared by every library of the VM.
-- A table is an array when its keys are exactly 1..n (n > 0); any other table is an object,
-- its keys written as strings (numbers as integers where whole, booleans as true/false):
-- the proto3 JSON form of map keys. The C side takes an array given for a map field as keys
-- 1..n, and an empty object for an empty repeated field.
local byte, format, gsub, concat = string.byte, string.format, string.gsub, table.concat
local floor, huge = math.floor, math.huge
local MAX_DEPTH = 100

local escapes = { ['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t" }
local function escape(c)
    return escapes[c] or format("\\u%04x", byte(c))
end

local function json_number(n)
    if n ~= n then
        return '"NaN"'
    elseif n == huge then
        return '"Infinity"'
    elseif n == -huge then
        return '"-Infinity"'
    elseif n == floor(n) and n > -1e21 and n < 1e21 then
        return format("%.0f", n)
    end
    return format("%.17g", n)
end

local int64_t, uint64_t = ffi.typeof("int64_t"), ffi.typeof("uint64_t")

-- A 64-bit integer cdata (`123LL`, `123ULL`) as its digits; nil for any other cdata.
local function cdata_integer(v)
    if ffi.istype(int64_t, v) or ffi.istype(uint64_t, v) then
        return (gsub(tostring(v), "U?LL$", ""))
    end
end

local function key_string(k)
    local t = type(k)
    if t == "string" then
        return k
    elseif t == "number" then
        return json_number(k):gsub('"', "")
    elseif t == "boolean" then
        return tostring(k)
    elseif t == "cdata" then
        return cdata_integer(k)
    end
end

local write_value

local function write_table(buf, t, depth, seen)
    if seen[t] then
        return "a table that contains itself"
    end
    if depth > MAX_DEPTH then
        return "tables nested deeper than " .. MAX_DEPTH
    end
    seen[t] = true
    local n, count = #t, 0
    for _ in pairs(t) do
        count = count + 1
    end
    local array = n > 0 and count == n
    for i = 1, array and n or 0 do
        if t[i] == nil then
            array = false -- a hole, and as many keys elsewhere
            break
        end
    end
    local err
    if array then
        buf[#buf + 1] = "["
        for i = 1, n do
            if i > 1 then
                buf[#buf + 1] = ","
            end
            err = write_value(buf, t[i], depth + 1, seen)
            if err then
                return err
            end
        end
        buf[#buf + 1] = "]"
    else
        buf[#buf + 1] = "{"
        local first, written = true, {}
        for k, v in pairs(t) do
            local key = key_string(k)
            if not key then
                return "a key of type " .. type(k) .. " (keys are strings, numbers or booleans)"
            end
            if written[key] then
                return "two keys that are both " .. key .. " as JSON (a number and a string, say)"
            end
            written[key] = true
            buf[#buf + 1] = (first and '"' or ',"') .. gsub(key, '[%c"\\]', escape) .. '":'
            first = false
            err = write_value(buf, v, depth + 1, seen)
            if err then
                return err
            end
        end
        buf[#buf + 1] = "}"
    end
    seen[t] = nil
end

write_value = function(buf, v, depth, seen)
    local t = type(v)
    if t == "string" then
        buf[#buf + 1] = '"' .. gsub(v, '[%c"\\]', escape) .. '"'
    elseif t == "number" then
        buf[#buf + 1] = json_number(v)
    elseif t == "boolean" then
        buf[#buf + 1] = v and "true" or "false"
    elseif t == "table" then
        return write_table(buf, v, depth, seen)
    elseif t == "userdata" and ((ngx and v == ngx.null) or (cjson and v == cjson.null)) then
        buf[#buf + 1] = "null"
    else
        local digits = t == "cdata" and cdata_integer(v)
        if not digits then
            return "a value of type " .. t
        end
        buf[#buf + 1] = '"' .. digits .. '"'
    end
end

-- A table as JSON text, or nil, err.
local function to_json(tbl)
    local buf = {}
    local err = write_value(buf, tbl, 0, {})
    if err then
        return nil, err
    end
    return concat(buf)
end
_M._to_json = to_json

local Proto = {}
Proto.__index = Proto

local function new_proto(handle)
    return setmetatable({ handle = ffi_gc(handle, C.isthmus_proto_free), types = {} }, Proto)
end

--- Compiles `.proto` files at run time (a path or a list of them; what they import is looked
--- up in `includes`, a directory or a list of them, then in the directory of each file under
--- none of those). Returns a proto for isthmus.connect's `proto` option, or nil, err.
function _M.load_proto(files, includes)
    local lerr = load_error()
    if lerr then
        return nil, lerr
    end
    if type(files) == "string" then
        files = { files }
    end
    if type(includes) == "string" then
        includes = { includes }
    end
    includes = includes or {}
    for _, arg in ipairs({ { "a .proto file", files }, { "an include directory", includes } }) do
        local what, list = arg[1], arg[2]
        if type(list) ~= "table" then
            return nil, new_error(INVALID_ARGUMENT, ("%s is a string or a list of them, not a %s"):format(what, type(list)))
        end
        for i = 1, #list do
            local _, err = c_string(what, list[i])
            if err then
                return nil, err
            end
        end
    end
    local cfiles = ffi_new("const char*[?]", #files, files)
    local cincludes = ffi_new("const char*[?]", #includes + 1, includes)
    local out = ffi_new("isthmus_proto_t*[1]")
    local rc = C.isthmus_proto_load(cfiles, #files, cincludes, #includes, out, status_out)
    if rc ~= OK then
        return nil, failed(rc)
    end
    return new_proto(out[0])
end

--- Loads a serialized FileDescriptorSet (`protoc --include_imports --descriptor_set_out`).
function _M.load_descriptor_set(bytes)
    local lerr = load_error()
    if lerr then
        return nil, lerr
    end
    if type(bytes) ~= "string" then
        return nil, new_error(INVALID_ARGUMENT, "a descriptor set is a string of bytes, not a " .. type(bytes))
    end
    local out = ffi_new("isthmus_proto_t*[1]")
    local rc = C.isthmus_proto_load_descriptor_set(bytes, #bytes, out, status_out)
    if rc ~= OK then
        return nil, failed(rc)
    end
    return new_proto(out[0])
end

-- The request (which = 0) or response (1) type of the method at `path`, or nil. Only the
-- methods the descriptors have are remembered: a path built from a request (a gateway's
-- `ngx.var.uri`) would otherwise grow the table by one entry per distinct path.
function Proto:method_type(path, which)
    local key = which .. path
    local name = self.types[key]
    if name == nil then
        local p = C.isthmus_proto_method_type(self.handle, path, which)
        if p == nil then
            return nil
        end
        name = ffi_string(p)
        self.types[key] = name
    end
    return name
end

-- Whether the client of the method at `path` sends a stream of requests: true, false, or nil
-- if the loaded services have no such method (not remembered, as method_type's).
function Proto:client_streams(path)
    local key = "s" .. path
    local known = self.types[key]
    if known == nil then
        local bits = tonumber(C.isthmus_proto_method_streams(self.handle, path))
        if bits < 0 then
            return nil
        end
        known = band(bits, PROTO_CLIENT_STREAMING) ~= 0
        self.types[key] = known
    end
    return known
end

--- Encodes a Lua table as a message of type `type_name`: ok, bytes or false, err.
function Proto:encode(type_name, tbl)
    local _, terr = c_string("the type name", type_name)
    if terr then
        return false, terr
    end
    local text, jerr = to_json(tbl)
    if not text then
        return false, new_error(INVALID_ARGUMENT, "cannot write the message as JSON: " .. tostring(jerr))
    end
    local out = ffi_new("isthmus_message_t*[1]")
    local rc = C.isthmus_proto_encode(self.handle, type_name, text, #text, out, status_out)
    if rc ~= OK then
        return false, failed(rc)
    end
    local message, merr = take_message(out[0])
    if merr then
        return false, merr
    end
    return true, message
end

--- Decodes the bytes of a `type_name` message into a Lua table: ok, table or false, err.
function Proto:decode(type_name, bytes)
    local _, terr = c_string("the type name", type_name)
    if terr then
        return false, terr
    end
    if type(bytes) ~= "string" then
        return false, new_error(INVALID_ARGUMENT, "a message is a string of bytes, not a " .. type(bytes))
    end
    local out = ffi_new("isthmus_message_t*[1]")
    local rc = C.isthmus_proto_decode(self.handle, type_name, bytes, #bytes, out, status_out)
    if rc ~= OK then
        return false, failed(rc)
    end
    local text, merr = take_message(out[0])
    if merr then
        return false, merr
    end
    local j, lerr = json()
    if not j then
        return false, new_error(FAILED_PRECONDITION, lerr)
    end
    local t, jerr = j.decode(text)
    if t == nil then
        return false, new_error(UNKNOWN, "cannot read the message's JSON: " .. tostring(jerr))
    end
    return true, t
end

---------------------------------------------------------------------------------------------
-- Waiting inside nginx: a completion queue, rung through a cosocket, and a semaphore per call
---------------------------------------------------------------------------------------------

-- The phase a coroutine may yield in now, or nil where it must block. (In a VM of
-- ngx.run_worker_thread, `ngx` has no get_phase: such a thread may block.)
local function yield_phase()
    local phase = ngx ~= nil and ngx.get_phase ~= nil and ngx.get_phase()
    if YIELDABLE[phase] then
        return phase
    end
end

local function can_yield()
    return yield_phase() ~= nil
end

-- The default deadline (seconds) of a blocking call or wait (made where it cannot yield) that
-- names none: `blocking_timeout` inside nginx, where it blocks the worker; nil in
-- ngx.run_worker_thread's VM and plain LuaJIT, where a wait holds no one else up.
local function blocking_default()
    if ngx ~= nil and ngx.get_phase ~= nil then
        return blocking_timeout
    end
end

-- The backstop of a wait with no deadline: none. A wait goes in slices of LOOK_S (an
-- ngx.semaphore wait is in whole milliseconds below 2^31), so it needs no finite bound: one of
-- 24 days ended a quiet stream's receive DEADLINE_EXCEEDED, a deadline nobody set.
local FOREVER = math.huge
local POLL_EVENTS = 64
-- The watcher's read never times out (an idle worker logs nothing): when the worker exits, a
-- timer that nginx fires early (premature) wakes it through the library instead.
local BELL_READ_MS = 2 ^ 31 - 1
local WAKE_AT_EXIT_S = 86400 * 365

local cq, events, now
local waiting = {}   -- tag -> waiter: { sema = ngx.semaphore, result = outcome }
local spare = {}     -- waiters for reuse
local next_tag = 0
local watching = false     -- a watcher runs, or its timer is made
local watcher = 0          -- the current watcher's number: a stale one leaves at once
local watcher_ran = false  -- the current watcher's timer has run
local watcher_made_at = 0  -- when its timer was made (ngx.now())
-- How long a call waits before it looks whether the watcher ever ran (nginx drops a timer it
-- cannot run: past lua_max_running_timers, or with no free connection) and prunes the calls
-- nobody waits for any more.
local LOOK_S = 1
-- How often the watcher prunes, at most: under load its bell rings for every few replies, and
-- each prune looks at every waiting operation.
local WATCHER_PRUNE_S = 0.01
local last_prune = 0
local prune_number = 0 -- the current prune timer's number: a stale one leaves at once
local prune_due        -- when the current prune timer is due (nil: none is made)

-- Streams end with the request that started them, as cosockets do: a stream a request left
-- open (no close() on some path out of its handler) otherwise held its server's handler until
-- Lua's garbage collector freed it, which in a quiet worker may be never. Stock
-- lua-nginx-module gives Lua no hook at a request's end; what it does there is release the
-- request's ngx.ctx table from lua-resty-core's registry of them, leaving its slot free (a
-- number or nil) until another request takes it. So each stream notes its request's slot, and
-- the prunes end those whose slot holds no table. A slot some later request has taken again
-- holds a table, and the stream waits for that one to end (under load, a collection may come
-- first): a table there cannot say whether it is a new request's or this one's replaced
-- (`ngx.ctx = t` puts it in the same slot), and a stream of a request still running is never
-- ended. stream -> slot, weak: a stream collected leaves (and the slot keeps nothing alive).
local owned = setmetatable({}, { __mode = "k" })
local last_orphan_look = 0
-- lua-resty-core's registry of ngx.ctx tables and what reads a request's slot in it, looked up
-- on first use (nil outside nginx's http subsystem, or if lua-resty-core keeps them elsewhere:
-- streams then live until closed or collected, as before).
local ctx_tables, get_ctx_ref, get_request
local ctx_looked = false
-- The phases with a request of their own that ends: not init_worker's, nor an SSL handshake's
-- (whose ngx.ctx passes on to the connection's requests). A subrequest's slot is freed with its
-- main request (they share a memory pool).
local OWNING = { set = true, rewrite = true, server_rewrite = true, access = true, content = true,
    balancer = true, timer = true, header_filter = true, body_filter = true, log = true }

-- An event as a plain outcome table; frees or takes over every handle in it.
local function outcome(ev)
    local r = { code = ev.code, op = ev.op }
    if ev.op == OP_STATE then
        r.state = tonumber(ev.message_len) -- a channel's state, changed or not
    end
    if ev.code ~= OK then
        r.err = take_status(ev.status, ev.code)
        if ev.metadata ~= nil then -- a failed unary call's initial metadata
            r.err.headers = take_metadata(ev.metadata)
        end
        return r
    end
    if ev.message ~= nil then
        r.message, r.err = message_string(ev.message_data, ev.message_len)
        if r.err then
            r.code = RESOURCE_EXHAUSTED
        end
        C.isthmus_message_free(ev.message)
    end
    if ev.metadata ~= nil then
        r.headers = take_metadata(ev.metadata)
    end
    if ev.trailers ~= nil then
        r.trailers = take_metadata(ev.trailers)
    end
    if ev.call ~= nil then
        r.call = ffi_gc(ev.call, C.isthmus_call_free)
    end
    if r.err and r.headers then -- a reply too long to take: its error carries the headers
        r.err.headers = r.headers
    end
    return r
end

-- Frees every handle an event holds, for one whose outcome could not be taken: those taken
-- already are refused by the library (its handles are never reused), so none is freed twice.
local function release(ev)
    if ev.message ~= nil then C.isthmus_message_free(ev.message) end
    if ev.metadata ~= nil then C.isthmus_metadata_free(ev.metadata) end
    if ev.trailers ~= nil then C.isthmus_metadata_free(ev.trailers) end
    if ev.status ~= nil then C.isthmus_status_free(ev.status) end
    if ev.call ~= nil then C.isthmus_call_free(ev.call) end
end

-- Hands every finished operation to its waiter. An outcome that raises (memory ran out) fails
-- its own operation, INTERNAL, and no other: a raise here ended the worker's watcher, and every
-- later call of the worker waited for its deadline.
local function dispatch()
    while true do
        local n = tonumber(C.isthmus_cq_poll(cq, events, POLL_EVENTS))
        for i = 0, n - 1 do
            local ev = events[i]
            local tag = tonumber(ev.tag)
            local ok, r = pcall(outcome, ev)
            if not ok then
                ngx.log(ngx.ERR, "resty.isthmus: an operation's outcome could not be taken: ", tostring(r))
                release(ev)
                r = { code = INTERNAL, err = new_error(INTERNAL, "resty.isthmus: the outcome could not be taken: " .. tostring(r)) }
            end
            local w = waiting[tag]
            if w then
                waiting[tag] = nil
            end
            if r.call ~= nil and not (w and w.sema:count() < 0) then
                -- A stream started for a coroutine that no longer waits (its request ended):
                -- nobody would ever hold the stream, and the call stayed open on the server
                -- until the garbage collector ran. It ends now, as an orphaned unary call does.
                C.isthmus_call_free(ffi_gc(r.call, nil))
            elseif w then
                w.result = r
                w.sema:post(1)
            end
        end
        if n < POLL_EVENTS then
            return
        end
    end
end

local watch, start_watching

-- The bell's socket while no watcher has connected to it (the library removes it, and its
-- directory, once one has): if none will, it is removed here, or it outlives the worker.
local bell_socket

local function forget_bell()
    if bell_socket then
        os.remove(bell_socket)
        os.remove(bell_socket:match("^(.*)/[^/]*$") or bell_socket)
        bell_socket = nil
    end
end

-- Once no operation waits: a watcher whose timer has not run, and may never (nginx drops one it
-- cannot run), is forgotten, and its bell with it, so that none outlives the worker. A late run
-- leaves at once; the next call makes one.
local function forget_unrun_watcher()
    if watching and not watcher_ran and next(waiting) == nil then
        watcher = watcher + 1
        watching = false
        forget_bell()
    end
end

-- The slot of the request a stream started now belongs to, or nil where none ends it.
local function request_owner()
    if not OWNING[ngx and ngx.get_phase and ngx.get_phase()] then
        return nil
    end
    if not ctx_looked then
        ctx_looked = true
        local ok, base = pcall(require, "resty.core.base")
        local tables = debug.getregistry().ngx_lua_ctx_tables
        if ok and type(tables) == "table" and ngx.config and ngx.config.subsystem == "http" then
            -- nginx's own symbol (ffi.C), which lua-resty-core's ngx.ctx, the registry's maker,
            -- declares.
            local found, fn = pcall(function() return ffi.C.ngx_http_lua_ffi_get_ctx_ref end)
            if found then
                ctx_tables, get_ctx_ref, get_request = tables, fn, base.get_request
            end
        end
    end
    if ctx_tables == nil then
        return nil
    end
    local ctx = ngx.ctx -- made now if the request has none: its slot is what is watched
    local r = get_request()
    if r == nil then
        return nil
    end
    local ref = tonumber(get_ctx_ref(r, nil, nil))
    if ref == nil or ref < 1 or not rawequal(rawget(ctx_tables, ref), ctx) then
        return nil -- not kept as expected: no end to watch for
    end
    return ref
end

-- Ends the streams whose request has ended: their server sees CANCELLED, and a later step on
-- one (from another request that kept it) fails CANCELLED, saying why.
local function end_orphaned_streams()
    last_orphan_look = ngx.now()
    for st, ref in pairs(owned) do
        if type(rawget(ctx_tables, ref)) ~= "table" then
            owned[st] = nil
            local call = st.call
            if call ~= nil and not st.ended then -- (one over, OK, holds nothing on the server)
                st.call = nil
                st.failure = st.failure or new_error(CANCELLED,
                    "resty.isthmus: the request that started the stream ended (a stream lives as long as its request, as a cosocket does)")
                st.trailers = st.trailers or {}
                C.isthmus_call_free(ffi_gc(call, nil)) -- cancels it if it still runs
            end
        end
    end
end

-- Abandons the operations whose coroutine no longer waits (its request was finalised, by a
-- client that went away or an ngx.exit from another light thread): nobody would take their
-- results, and an operation with no deadline would stay forever. A unary call ends with its
-- operation; a stream's step does not end the stream, which other light threads of a request may
-- still use: a stream ends with its request (end_orphaned_streams), or when it is collected.
-- `own`: the tag of the caller's operation, if a caller prunes (it is not waiting on its
-- semaphore just then).
local function prune(own)
    last_prune = ngx.now()
    for tag, w in pairs(waiting) do
        if tag ~= own and w.sema:count() >= 0 then
            local st = w.stream
            -- A stream's receive that has finished keeps its waiter: its message, queued, is the
            -- stream's next, and dispatch hands it over for the next receive to take.
            local finished = C.isthmus_cq_cancel(cq, tag) == NOT_FOUND
            if not (finished and st) then
                waiting[tag] = nil
                if st and st.left_recv and st.left_recv.tag == tag then
                    st.left_recv = nil
                end
            end
        end
    end
    if next(owned) ~= nil and ngx.now() - last_orphan_look >= LOOK_S then
        end_orphaned_streams()
    end
    forget_unrun_watcher()
    if ngx.worker.exiting() and next(waiting) == nil then
        C.isthmus_cq_wake(cq) -- a cancelled operation rings no bell: the watcher may leave now
    end
end

-- Prunes each LOOK_S while operations wait, so that those whose request ended go even when no
-- other call waits (whose own wait prunes too) and no bell rings: a unary call abandoned with
-- no deadline in an idle worker held its server's handler for as long as that took.
local prune_tick

local function arm_prune()
    prune_number = prune_number + 1
    prune_due = ngx.now() + LOOK_S
    if not ngx.timer.at(LOOK_S, prune_tick, prune_number) then
        prune_due = nil -- none left: the calls still prune each other, as before
    end
end

-- Arms the prune timer unless one is due (or the worker exits). One long overdue is made anew:
-- nginx drops a timer it cannot run.
local function prune_soon()
    if not ngx.worker.exiting() and (prune_due == nil or ngx.now() - prune_due > LOOK_S) then
        arm_prune()
    end
end

prune_tick = function(premature, number)
    if number ~= prune_number then
        return -- taken for lost (nginx dropped it), and another made
    end
    prune_due = nil
    if premature then
        return -- the worker exits: the watcher prunes from here on
    end
    if ngx.now() - last_prune >= LOOK_S then
        prune()
    end
    if next(waiting) ~= nil or next(owned) ~= nil then
        arm_prune()
    end
end

-- Fails every waiting operation (the watcher could not run).
local function fail_all(why)
    for tag, w in pairs(waiting) do
        C.isthmus_cq_cancel(cq, tag)
        waiting[tag] = nil
        w.result = { code = UNAVAILABLE, err = new_error(UNAVAILABLE, "resty.isthmus: " .. why) }
        w.sema:post(1)
    end
end

-- The worker's one watcher of the completion queue, in a timer: it sleeps on the cosocket the
-- library rings whenever operations finish, and hands them out. Run early (premature) as the
-- worker exits, it still serves the calls in flight.
watch = function(premature, path, number)
    if number ~= watcher then
        return -- its timer was taken for lost, and another watcher made
    end
    watcher_ran = true
    if premature and next(waiting) == nil then
        watching = false
        forget_bell()
        return
    end
    local sock = ngx.socket.tcp()
    local ok, err = sock:connect("unix:" .. path)
    if ok then
        local rc = C.isthmus_cq_bell_accept(cq, status_out)
        if rc ~= OK then
            ok, err = false, tostring(failed(rc))
        else
            bell_socket = nil -- the library removed it
        end
    end
    if not ok then
        watching = false
        forget_bell()
        ngx.log(ngx.ERR, "resty.isthmus: cannot watch the completion queue: ", err)
        fail_all("cannot watch the completion queue: " .. tostring(err))
        return
    end
    sock:settimeouts(nil, nil, BELL_READ_MS)
    while true do
        dispatch()
        -- Looked at once the queue is drained: the bell that brought an exiting worker's last
        -- reply was read before that reply was dispatched, and no other bell would come. The
        -- calls nobody waits for any more would hold the worker: they go first.
        if ngx.worker.exiting() then
            prune()
            if next(waiting) == nil then
                break
            end
            -- No prune timer runs now (nginx fires it early, and makes no new one): the bell is
            -- read in slices, so that a call abandoned meanwhile (its client went away) is
            -- pruned, and the worker can exit, rather than wait for a reply that may never come.
            sock:settimeouts(nil, nil, LOOK_S * 1000)
        end
        local data, rerr = sock:receiveany(4096)
        if not data and rerr ~= "timeout" then
            err = rerr
            break
        end
        if ngx.now() - last_prune >= WATCHER_PRUNE_S then
            prune()
        end
    end
    sock:close()
    watching = false
    dispatch()
    if next(waiting) ~= nil and not ngx.worker.exiting() then
        ngx.log(ngx.WARN, "resty.isthmus: the completion queue's bell closed (", tostring(err), "); watching anew")
        local ok, serr = start_watching()
        if not ok then
            fail_all("cannot watch the completion queue anew: " .. tostring(serr))
        end
    end
end

local bell_path = ffi_new("char[512]")
local exit_timer

-- Wakes the watcher when the worker exits (the timer fires early, premature), so that it sees
-- the exit; one that fires on its own (a year on) is armed again, or the next exit would find
-- none while the watcher lives on.
local function wake_at_exit(premature)
    exit_timer = nil
    C.isthmus_cq_wake(cq)
    if not premature and not ngx.worker.exiting() then
        exit_timer = ngx.timer.at(WAKE_AT_EXIT_S, wake_at_exit)
    end
end

start_watching = function()
    if watching then
        return true
    end
    watcher = watcher + 1
    watcher_ran, watcher_made_at = false, ngx.now()
    local rc = C.isthmus_cq_bell_listen(cq, bell_path, 512, status_out)
    if rc ~= OK then
        return nil, failed(rc)
    end
    bell_socket = ffi_string(bell_path)
    -- The timer that wakes the watcher when the worker exits comes first; while the worker is
    -- exiting there is none to make, and the watcher ends with the last call's reply.
    local ok, err = true, nil
    if not exit_timer and not ngx.worker.exiting() then
        exit_timer, err = ngx.timer.at(WAKE_AT_EXIT_S, wake_at_exit)
        ok = exit_timer ~= nil
    end
    if ok then
        ok, err = ngx.timer.at(0, watch, bell_socket, watcher)
    end
    if not ok then
        forget_bell()
        return nil, new_error(UNAVAILABLE, "resty.isthmus: cannot start the completion queue's watcher: " .. tostring(err))
    end
    watching = true
    return true
end

-- A new completion queue, which lives as long as the worker; nil, err if it cannot be made (no
-- file descriptor left).
local function new_queue()
    local q = C.isthmus_cq_new()
    if q == nil then
        return nil, new_error(UNAVAILABLE, "resty.isthmus: cannot make a completion queue (no descriptor left?)")
    end
    return q
end

-- The worker's completion queue; nil, err if it cannot be made.
local function queue()
    if not cq then
        local q, err = new_queue()
        if not q then
            return nil, err
        end
        cq = q
        events = ffi_new("isthmus_event_t[?]", POLL_EVENTS)
        now = ffi_new("isthmus_event_t[1]")
    end
    return cq
end

-- Whether a call should wait for a fast reply on the worker's thread: only while the worker is
-- not interleaving requests. A request making calls one after another (the same request as the
-- last call) or the first call after a quiet spell gains the reply without a wake-up; while
-- calls of many requests alternate (the worker under load), every microsecond spent spinning is
-- taken from the other requests, and their replies come in batches through the bell anyway.
local QUIET_S = 0.002
-- The last caller, held weakly: a finished request's ngx.ctx may hold much of its user's data.
local last_caller = setmetatable({}, { __mode = "v" })
local last_call_at = 0

-- Phases whose ngx.ctx is the request's own table (a timer's is the timer's).
local CTX_PHASES = { rewrite = true, server_rewrite = true, access = true, content = true, timer = true }

-- What names the request a call comes from. Not its coroutine: lua-nginx-module hands a
-- finished request's coroutine to the next request (lua_thread_cache_max_entries), whose first
-- call then passed for the last request's next one and spun under load (docs/adr/0011). In the
-- ssl_* phases, which have no ngx.ctx of their own, the coroutine stands for the request.
local function caller(phase)
    if CTX_PHASES[phase] then
        return ngx.ctx
    end
    return coroutine.running()
end
_M._caller = caller -- for lua/tests: the request a call is taken to come from

-- `phase`: the (yieldable) phase the call is made in.
local function worth_spinning(phase)
    if next(waiting) ~= nil then
        return false
    end
    local who, at = caller(phase), ngx.now()
    local spin = who == last_caller[1] or at - last_call_at > QUIET_S
    last_caller[1], last_call_at = who, at
    return spin
end

local function fresh_tag()
    next_tag = next_tag + 1
    return next_tag
end

-- What a wait does each LOOK_S it lasts: a watcher whose timer nginx dropped is made anew (or
-- every call would wait for its backstop), and the operations nobody waits for are pruned.
local function look_while_waiting(tag)
    local at = ngx.now()
    if watching and not watcher_ran and at - watcher_made_at >= LOOK_S then
        ngx.log(ngx.WARN, "resty.isthmus: the completion queue's watcher never ran (nginx dropped its timer: ",
            "lua_max_running_timers, or no free connection?); making it anew")
        watching = false
        local started, serr = start_watching()
        if not started then
            fail_all("cannot start the completion queue's watcher anew: " .. tostring(serr))
        end
    end
    if at - last_prune >= LOOK_S then
        prune(tag)
    end
end

-- The rest of a wait that outlasted its first LOOK_S, until `deadline`. A function of its own so
-- that `await`, which nearly every call leaves after one slice, holds no loop: LuaJIT compiles no
-- trace through an inner loop, and gave up on every call path that reached one (blacklisted,
-- they ran interpreted: about 2 µs more per call under wrk).
local function await_longer(w, tag, deadline)
    while true do
        look_while_waiting(tag)
        local left = deadline - ngx.now()
        if left <= 0 then -- a slice that ended late
            return nil, "timeout"
        end
        local ok, err = w.sema:wait(left < LOOK_S and left or LOOK_S)
        if ok or err ~= "timeout" or left <= LOOK_S then
            return ok, err
        end
    end
end

-- Waits for waiter `w` of operation `tag` at most `backstop` seconds, like `w.sema:wait`, looking
-- every LOOK_S that the watcher runs (look_while_waiting).
local function await(w, tag, backstop)
    if backstop <= 0 then
        return nil, "timeout"
    end
    local deadline = ngx.now() + backstop
    local ok, err = w.sema:wait(backstop < LOOK_S and backstop or LOOK_S)
    if ok or err ~= "timeout" or backstop <= LOOK_S then
        return ok, err
    end
    return await_longer(w, tag, deadline)
end

-- What an _async start that returned `rc` came to at once: its failure, or its outcome if it
-- finished in `ev` (the `now` it was given; the library clears it otherwise); nil while it runs.
local function at_once(rc, ev)
    if rc ~= OK then
        return { code = rc, err = failed(rc) }
    end
    if ev[0].op ~= 0 then
        return outcome(ev[0])
    end
end

-- After an _async start that returned `rc`: its outcome if it came at once (in `now`), else
-- the waiter it is registered under (the watcher started if need be).
local function begin_wait(rc, tag)
    local done = at_once(rc, now)
    if done then
        return done
    end
    local w = spare[#spare]
    if w then
        spare[#spare] = nil
    else
        w = { sema = require("ngx.semaphore").new() }
    end
    waiting[tag] = w
    if not watching then
        local ok, err = start_watching()
        if not ok then
            waiting[tag] = nil
            C.isthmus_cq_cancel(cq, tag)
            return { code = err.code, err = err }
        end
    end
    -- After the watcher, which a call needs, so that this one never takes the last timer.
    prune_soon()
    return nil, w
end

-- Waits on waiter `w` for operation `tag`'s outcome; `limit` bounds the wait (seconds) beyond the
-- call's own deadline. With `own` it is a receive's own timeout instead, past which the
-- operation is taken back but not the call: the outcome is { timed_out = true }, and the stream
-- goes on (one that finished as the time ran out gives its outcome; its waiter, posted to
-- nobody, is not reused).
local function wait_on(w, tag, limit, own)
    local ok, err = await(w, tag, limit)
    if ok then
        local r = w.result
        w.result = nil
        spare[#spare + 1] = w
        return r
    end
    if C.isthmus_cq_cancel(cq, tag) == NOT_FOUND and own and err == "timeout" then
        if w.result == nil then
            dispatch() -- its event is queued: handed to `w` now
        end
        local r = w.result
        w.result = nil
        if r then
            return r
        end
    end
    waiting[tag] = nil
    forget_unrun_watcher()
    if ngx.worker.exiting() and next(waiting) == nil then
        C.isthmus_cq_wake(cq) -- a cancelled operation rings no bell: the watcher may leave now
    end
    if err ~= "timeout" then
        return { code = UNKNOWN, err = new_error(UNKNOWN, "resty.isthmus: waiting failed: " .. tostring(err)) }
    elseif own then
        return { timed_out = true }
    end
    return { code = DEADLINE_EXCEEDED, err = new_error(DEADLINE_EXCEEDED, "resty.isthmus: no answer in time") }
end

-- After an _async start that returned `rc`: the outcome, at once (in `now`) or after waiting on
-- the semaphore; `backstop` bounds the wait (seconds) beyond the call's own deadline.
local function finish_async(rc, tag, backstop)
    local done, w = begin_wait(rc, tag)
    if done then
        return done
    end
    return wait_on(w, tag, backstop)
end

-- Whether no coroutine waits on waiter `w` any more, nor is about to resume with its outcome
-- (the one that waited was killed, or its request ended): nobody waits and no outcome came
-- (count 0, no result), or the outcome was posted to nobody (count 1). Posted to a coroutine
-- that has not resumed yet, the count is 0 with a result.
local function abandoned(w)
    local n = w.sema:count()
    return n >= 1 or (n == 0 and w.result == nil)
end

---------------------------------------------------------------------------------------------
-- Channels and calls
---------------------------------------------------------------------------------------------

-- How long a unary call waits on the worker's thread for a fast reply before it yields: a
-- server that spins answers in 2-5 µs, and under load a longer wait only takes the worker (and
-- the core) from other requests (docs/adr/0011).
local DEFAULT_SPIN_US = 10

local Channel = {}
Channel.__index = Channel

local Stream = {}
Stream.__index = Stream

-- connect's `tls` keys and the fields of isthmus_tls_options_t they fill; the `_file` forms
-- name a file to read the same PEM text from.
local TLS_KEYS = {
    ca = "root_certs_pem", cert = "cert_chain_pem", key = "private_key_pem", server_name = "server_name",
}
local TLS_FILES = { ca_file = "ca", cert_file = "cert", key_file = "key" }

-- The library names the C fields in its errors; a Lua caller gave these keys.
local TLS_WORDS = {
    { "tls%.root_certs_pem", "tls.ca" },
    { "tls%.cert_chain_pem", "tls.cert" },
    { "tls%.private_key_pem", "tls.key" },
    { "cert_chain_pem and private_key_pem", "tls.cert and tls.key" },
}

-- `err` from isthmus_channel_new, in the words of connect's options.
local function in_lua_words(err)
    local message = err.message
    for _, w in ipairs(TLS_WORDS) do
        message = message:gsub(w[1], w[2])
    end
    err.message = message
    return err
end

-- What isthmus_channel_new reads through pointers while it runs: the TLS struct and its strings
-- hang from pointer fields, which the garbage collector does not follow; reachable from here,
-- they live until the call has copied them.
local pinned

local function tls_error(fmt, ...)
    return nil, new_error(INVALID_ARGUMENT, "tls." .. fmt:format(...))
end

-- connect's `tls` table as an isthmus_tls_options_t, or nil, err; `keep` holds what the struct
-- points to.
local function tls_options(t, keep)
    if type(t) ~= "table" then
        return nil, new_error(INVALID_ARGUMENT, "the tls option is a table, not a " .. type(t))
    end
    for k, v in pairs(t) do
        local name = TLS_FILES[k] or k
        if not TLS_KEYS[name] then
            return tls_error("%s: no such option (ca, cert, key, their _file forms, server_name)", tostring(k))
        end
        if type(v) ~= "string" then
            return tls_error("%s is a string, not a %s", k, type(v))
        end
        if v:find("\0", 1, true) then
            -- C (and io.open) would end the string there: a server name cut short is verified
            -- as the shorter name, a path opens another file.
            return tls_error("%s holds a NUL", k)
        end
        if TLS_FILES[k] and t[name] ~= nil then
            return tls_error("%s and tls.%s: give one of the two", name, k)
        end
    end
    local text = {}
    for k, v in pairs(t) do
        if TLS_FILES[k] then
            -- Blocks the worker while it reads: one small file per channel, made once per worker.
            local f, err = io.open(v, "rb")
            if not f then
                return tls_error("%s: %s", k, err)
            end
            v, err = f:read("*a")
            f:close()
            if not v then
                return tls_error("%s: %s", k, err)
            end
        end
        text[TLS_FILES[k] or k] = v
    end
    if (text.cert == nil) ~= (text.key == nil) then
        return tls_error("cert and tls.key go together (a client certificate and its key)")
    end
    local c = ffi_new("isthmus_tls_options_t")
    for name, field in pairs(TLS_KEYS) do
        if text[name] then
            keep[#keep + 1] = text[name]
            c[field] = text[name]
        end
    end
    keep[#keep + 1] = c
    return c
end

-- Refuses an option `opts` does not know, rather than ignore it: a misspelt one set nothing
-- (`{ timeout_ms = 100 }` left a call with no deadline at all). nil if every key is known.
local function unknown_option(opts, known, what)
    for key in pairs(opts) do
        if not known[key] then
            return new_error(INVALID_ARGUMENT, ("%s has no option %s"):format(what, tostring(key)))
        end
    end
end

local CONNECT_OPTIONS = { proto = true, max_message_size = true, tls = true, spin_us = true, spin = true,
    lib = true, upgrade = true, keepalive_time_ms = true, keepalive_timeout_ms = true,
    keepalive_without_calls = true, user_agent = true, authority = true, connect_timeout_ms = true }

--- Makes a channel to `target` (`shm://NAME`, `unix:///path.sock`, `http://host:port`,
--- `https://host:port`, or gRPC's other names: `host:port`, `dns:`, `ipv4:`...). It connects
--- on its first call, and again after the server went away. Options: `proto` (from
--- isthmus.load_proto: lets calls take and return Lua tables), `max_message_size` (bytes),
--- `tls` (below), `spin_us` (how long a unary call may wait for a fast reply before it yields,
--- 10 by default; a large request waits up to 50 µs more, by its size), `spin` (false: never
--- wait), `lib` (the library's path), and for HTTP/2 targets `keepalive_time_ms` (a PING
--- after that long without a frame while a call is open; if its answer does not come within
--- `keepalive_timeout_ms`, 20000 by default, the connection closes and its calls fail
--- UNAVAILABLE; `keepalive_without_calls = true` pings while none is open too), and
--- `user_agent` (what the calls name as gRPC's `user-agent`, which the server's handlers see
--- in their metadata; over HTTP/2 the library's own agent follows it), and `authority` (the
--- `:authority` HTTP/2 calls send in place of the target's, `host[:port]`, as grpc-go's
--- `WithAuthority`; TLS then checks the server's certificate against its host unless
--- `tls.server_name` names another), and `connect_timeout_ms` (how long a connection may take
--- to come up, its TLS handshake and the server's SETTINGS included, 20000 by default as
--- gRPC's; past it the calls waiting on it fail UNAVAILABLE).
--- `tls` makes a TCP target's connection TLS (`https://` is TLS without it, verified against
--- the system's roots): `ca` (PEM text of the CAs that sign the server's certificate; nil: the
--- system's roots), `cert` and `key` (PEM text of a client certificate and its key, for
--- mutual TLS), `server_name` (the name the server's certificate must carry, in place of the
--- target's host); `ca_file`, `cert_file` and `key_file` name files to read the PEM from
--- instead (read as connect runs: it blocks that long). `tls = {}` is TLS with the system's
--- roots. TLS on `shm://` or `unix://`, and PEM that does not parse, are INVALID_ARGUMENT here;
--- a certificate the other side refuses fails the calls UNAVAILABLE, saying why.
--- One channel per worker, made in init_worker_by_lua or on first use, serves every request.
--- An option it does not know is INVALID_ARGUMENT, as one a call does not know is a call's.
--- Returns the channel, or nil, err.
function _M.connect(target, opts)
    if opts ~= nil and type(opts) ~= "table" then
        return nil, new_error(INVALID_ARGUMENT, "connect's options are a table, not a " .. type(opts))
    end
    opts = opts or {}
    local uerr = unknown_option(opts, CONNECT_OPTIONS, "connect")
    if uerr then
        return nil, uerr
    end
    local lerr = load_error(opts.lib)
    if lerr then
        return nil, lerr
    end
    -- nil is the library's to refuse (INVALID_ARGUMENT "the target is NULL").
    if target ~= nil then
        local _, terr = c_string("the target", target)
        if terr then
            return nil, terr
        end
    end
    -- A switch is true or false: any other value ("no", 0) would count as true.
    for _, key in ipairs({ "upgrade", "keepalive_without_calls", "spin" }) do
        local v = opts[key]
        if v ~= nil and type(v) ~= "boolean" then
            return nil, new_error(INVALID_ARGUMENT, key .. " is true or false, not " .. tostring(v))
        end
    end
    -- Checked before the channel exists: a value the ffi cannot convert raised after it was
    -- made, and the channel leaked.
    for _, key in ipairs({ "max_message_size", "spin_us", "keepalive_time_ms", "keepalive_timeout_ms",
        "connect_timeout_ms" }) do
        local v = opts[key]
        -- (NaN fails `v == math.floor(v)`; infinity and counts past 2^32 are no sizes here.)
        if v ~= nil and (type(v) ~= "number" or v < 0 or v ~= math.floor(v) or v >= 2 ^ 53
            or (key == "spin_us" and v > 4294967295)) then
            return nil, new_error(INVALID_ARGUMENT, key .. " is a whole number, 0 or more, not " .. tostring(v))
        end
    end
    local copts = ffi_new("isthmus_channel_options_t")
    copts.max_message_size = opts.max_message_size or 0
    if opts.upgrade ~= nil then
        copts.flags = opts.upgrade and CHANNEL_UPGRADE or CHANNEL_NO_UPGRADE
    end
    copts.keepalive_time_ms = opts.keepalive_time_ms or 0
    copts.keepalive_timeout_ms = opts.keepalive_timeout_ms or 0
    copts.connect_timeout_ms = opts.connect_timeout_ms or 0
    if opts.keepalive_without_calls then
        copts.flags = bor(copts.flags, CHANNEL_KEEPALIVE_WITHOUT_CALLS)
    end
    local keep = {}
    for _, key in ipairs({ "user_agent", "authority" }) do
        local v = opts[key]
        if v ~= nil then
            if type(v) ~= "string" then
                return nil, new_error(INVALID_ARGUMENT, key .. " is a string, not " .. type(v))
            end
            if v:find("\0", 1, true) then
                -- C would end the string there: refused, as the library refuses any control byte.
                return nil, new_error(INVALID_ARGUMENT, key:gsub("_", " ") .. " must be printable ASCII")
            end
            keep[#keep + 1] = v
            copts[key] = v
        end
    end
    if opts.tls ~= nil then
        local tls, err = tls_options(opts.tls, keep)
        if not tls then
            return nil, err
        end
        copts.tls = tls
    end
    local out = ffi_new("isthmus_channel_t*[1]")
    pinned = keep
    local rc = C.isthmus_channel_new(target, copts, out, status_out)
    pinned = nil
    if rc ~= OK then
        return nil, in_lua_words(failed(rc))
    end
    local handle = ffi_gc(out[0], C.isthmus_channel_close)
    C.isthmus_channel_set_spin(handle, opts.spin_us or DEFAULT_SPIN_US)
    return setmetatable({
        handle = handle,
        target = target,
        proto = opts.proto,
        spin = opts.spin ~= false,
    }, Channel)
end

--- Closes the channel; calls in progress go on until they end.
function Channel:close()
    local h = self.handle
    if h ~= nil then
        self.handle = nil
        C.isthmus_channel_close(ffi_gc(h, nil))
    end
    return true
end

local state_out = ffi_new("uint32_t[1]")

--- The channel's connectivity state, as gRPC names it: "IDLE" (no connection yet),
--- "CONNECTING", "READY", "TRANSIENT_FAILURE" (the last attempt failed) or "SHUTDOWN"
--- (closed). With `try_to_connect`, an idle or failed channel starts connecting in the
--- background, retrying with backoff. Never waits: watch it from a timer.
function Channel:state(try_to_connect)
    local h = self.handle
    if h == nil or C.isthmus_channel_state(h, try_to_connect and 1 or 0, state_out) ~= OK then
        return "SHUTDOWN"
    end
    return STATES[tonumber(state_out[0])]
end

local STATE_NUMBERS = {}
for n, name in pairs(STATES) do STATE_NUMBERS[name] = n end
local WAIT_MS_MAX = 2 ^ 32 - 1

--- Waits until the channel's state is not `last` (a name, as `state` gives it), for `timeout`
--- seconds at most (nil: no limit): true, the new state; or false, err, with err.code
--- DEADLINE_EXCEEDED and err.state `last` once the time ran out (grpc-go's
--- WaitForStateChange). In a yieldable phase the worker serves other requests meanwhile;
--- elsewhere (init_worker, plain LuaJIT) it blocks, in nginx for `blocking_timeout` at most
--- (`init`) if `timeout` is nil. A closed channel is "SHUTDOWN", for good.
function Channel:wait_state(last, timeout)
    local from = STATE_NUMBERS[last]
    if from == nil then
        return false, new_error(INVALID_ARGUMENT, ("%s is not a connectivity state"):format(tostring(last)))
    end
    if timeout ~= nil and type(timeout) ~= "number" then
        return false, new_error(INVALID_ARGUMENT, "the timeout is a number of seconds, not a " .. type(timeout))
    end
    -- NaN would never end the wait's backstop. A timeout too long for the library's
    -- milliseconds (math.huge, say), whose conversion to an integer C leaves undefined, is
    -- what nil says; one of 0 or less has run out (DEADLINE_EXCEEDED, as a call's).
    if timeout ~= timeout then
        return false, new_error(INVALID_ARGUMENT, "the timeout is a number of seconds, not NaN")
    end
    local unbounded = timeout ~= nil and timeout >= 2 ^ 50
    local h = self.handle
    if h == nil then
        if last ~= "SHUTDOWN" then
            return true, "SHUTDOWN"
        end
        return false, new_error(UNAVAILABLE, "the channel is closed")
    end
    if can_yield() then
        local q, qerr = queue()
        if not q then
            return false, qerr
        end
        local tag = fresh_tag()
        if unbounded then
            timeout = nil
        end
        local ms = timeout and math.max(math.ceil(timeout * 1000), 0) or -1
        local rc = C.isthmus_channel_wait_state_async(h, from, ms, q, tag, now, status_out)
        local r = finish_async(rc, tag, (timeout or FOREVER) + 1)
        if r.err then
            r.err.state = r.state and STATES[r.state]
            return false, r.err
        end
        return true, STATES[r.state]
    end
    timeout = timeout or blocking_default()
    local ms = timeout and not unbounded and math.min(math.max(math.ceil(timeout * 1000), 0), WAIT_MS_MAX)
        or WAIT_MS_MAX
    local rc = C.isthmus_channel_wait_state(h, from, ms, state_out)
    if rc == OK then
        return true, STATES[tonumber(state_out[0])]
    end
    local err = new_error(rc, rc == DEADLINE_EXCEEDED and ("the state stayed %s"):format(last) or "the wait failed")
    err.state = rc == DEADLINE_EXCEEDED and last or nil
    return false, err
end

-- The fields of isthmus_stats_t a channel's stats give, besides calls_finished. (The header's
-- struct goes on with a server's fields, which a channel leaves 0: this one stops before them,
-- and the library writes no more than its size.)
local STATS_FIELDS = {
    "calls_started", "calls_in_flight", "frames_sent", "frames_received", "bytes_sent",
    "bytes_received", "doorbells_rung", "sleeps", "spin_hits", "ring_full_waits",
    "arena_full_waits", "arena_in_use", "arena_high_water", "shared_sent", "answers_dropped",
}
local stats_out = ffi_new("isthmus_stats_t")

--- The counters of the channel's shm:// connections (for a target over HTTP/2, of the one it
--- moved to; calls over HTTP/2 are not counted), as a table of numbers: calls_started, calls_in_flight, calls_finished (by code name:
--- `stats.calls_finished.UNAVAILABLE`), frames_sent/_received, bytes_sent/_received,
--- doorbells_rung, sleeps, spin_hits, ring_full_waits, arena_full_waits, arena_in_use (this
--- side's shared memory allocated now), arena_high_water and answers_dropped. They start afresh
--- when the channel reconnects. `nil, err` for a closed channel. Never waits.
function Channel:stats()
    local h = self.handle
    if h == nil then
        return nil, new_error(INVALID_ARGUMENT, "the channel is closed")
    end
    local out = stats_out
    local rc = C.isthmus_channel_stats(h, out, ffi.sizeof(out))
    if rc ~= OK then
        return nil, new_error(rc, "isthmus_channel_stats failed")
    end
    local t = { calls_finished = {} }
    for _, field in ipairs(STATS_FIELDS) do
        t[field] = tonumber(out[field])
    end
    for code = 0, 16 do
        t.calls_finished[CODE_NAMES[code]] = tonumber(out.calls_finished[code])
    end
    return t
end

-- ISTHMUS_CALL_COMPRESS_* by grpc-encoding name.
local COMPRESSION_FLAGS = { gzip = 4, deflate = 8 }

local CALL_OPTIONS = { timeout = true, metadata = true, wait_for_ready = true, compression = true, raw = true }

-- table.nkeys of OpenResty's LuaJIT (Debian's luajit2, under nginx and outside): a count of a
-- table's keys that LuaJIT compiles. Without it, call options are checked by unknown_option alone.
local nkeys_found, nkeys = pcall(require, "table.nkeys")
if not nkeys_found then
    nkeys = nil
end

-- Whether call options `opts` may hold a key CALL_OPTIONS lacks: more keys than it names. Looked
-- up by name, with no loop: LuaJIT gives up on a trace that meets an inner loop, so a loop here
-- kept every call made with options from being compiled before it; unknown_option, which loops,
-- runs only when the counts differ.
local function may_hold_unknown(opts)
    if nkeys == nil then
        return true
    end
    -- rawget: nkeys counts the table's own keys, not those an __index would give.
    local named = (rawget(opts, "timeout") ~= nil and 1 or 0) + (rawget(opts, "metadata") ~= nil and 1 or 0)
        + (rawget(opts, "wait_for_ready") ~= nil and 1 or 0) + (rawget(opts, "compression") ~= nil and 1 or 0)
        + (rawget(opts, "raw") ~= nil and 1 or 0)
    return nkeys(opts) ~= named
end

-- The C options of one call; the metadata handle is returned so that it lives until the call
-- has copied it. A call with no timeout of its own takes `default` (seconds, or nil: none).
local function call_options(opts, flags, default)
    if opts ~= nil and type(opts) ~= "table" then
        return nil, new_error(INVALID_ARGUMENT, "a call's options are a table, not a " .. type(opts))
    end
    local uerr = opts and may_hold_unknown(opts) and unknown_option(opts, CALL_OPTIONS, "a call")
    if uerr then
        return nil, uerr
    end
    local o = ffi_new("isthmus_call_options_t")
    local md, err
    local timeout = opts and opts.timeout or default
    if timeout then
        if type(timeout) ~= "number" or timeout ~= timeout then
            return nil, new_error(INVALID_ARGUMENT, "timeout is a number of seconds, not " .. tostring(timeout))
        end
        -- The library takes whole microseconds, and 0 or less as no deadline at all: a
        -- budget that is spent fails here, as a passed deadline; under a microsecond is one
        -- (truncated, it was 0).
        local us = math.ceil(timeout * 1e6)
        if us <= 0 then
            return nil, new_error(DEADLINE_EXCEEDED, "the call's deadline passed before it started (timeout "
                .. tostring(timeout) .. " s)")
        end
        -- One past the library's int64 microseconds (`math.huge` too) is no deadline, as the
        -- library reads a timeout too long for its clock: converted, it was whatever the CPU
        -- makes of a double out of range.
        if us < 2 ^ 63 then
            o.timeout_us = us
        end
    end
    if opts then
        md, err = make_metadata(opts.metadata)
        if err then
            return nil, err
        end
        o.metadata = md
        if opts.wait_for_ready then
            flags = flags + 1
        end
        if opts.compression ~= nil then
            local flag = COMPRESSION_FLAGS[opts.compression]
            if not flag then
                free_metadata(md)
                return nil, new_error(INVALID_ARGUMENT,
                    "compression " .. tostring(opts.compression) .. ": \"gzip\" or \"deflate\"")
            end
            flags = flags + flag
        end
    end
    o.flags = flags
    return o, md
end

-- How long a yielding wait may last beyond the call's own deadline (which the library keeps).
local function backstop(opts)
    return opts and opts.timeout and opts.timeout + 5 or FOREVER
end

-- The codec of a call on `path`: whether replies become tables, and the types.
function Channel:_codec(path, opts)
    local p = self.proto
    -- Options that are no table are call_options' to refuse, after this.
    if p == nil or (type(opts) == "table" and opts.raw) then
        return nil
    end
    local req = p:method_type(path, PROTO_REQUEST)
    if req == nil then
        return nil
    end
    return { proto = p, request = req, response = p:method_type(path, PROTO_RESPONSE) }
end

-- A request as bytes: strings as they are, tables through the proto.
local function encode(self, codec, path, request)
    if type(request) == "string" then
        return true, request
    end
    if type(request) ~= "table" then
        return false, new_error(INVALID_ARGUMENT, "a request is a string (its bytes) or a table, not a " .. type(request))
    end
    if codec == nil then
        local p = self.proto
        if p == nil then
            return false, new_error(INVALID_ARGUMENT, "a table request needs the channel's proto option (isthmus.load_proto)")
        end
        local req = p:method_type(path, PROTO_REQUEST)
        if req == nil then
            return false, new_error(INVALID_ARGUMENT, "the channel's proto has no method " .. path)
        end
        return p:encode(req, request)
    end
    return codec.proto:encode(codec.request, request)
end

local function decode(codec, bytes)
    if codec == nil or bytes == nil then
        return true, bytes
    end
    local ok, reply = codec.proto:decode(codec.response, bytes)
    if ok then
        return true, reply
    end
    -- gRPC's code for a response the client cannot parse (the server did answer).
    return false, new_error(INTERNAL, "the reply could not be read: " .. reply.message)
end

local reply_out = ffi_new("isthmus_message_t*[1]")
local headers_out = ffi_new("isthmus_metadata_t*[1]")
local trailers_out = ffi_new("isthmus_metadata_t*[1]")

--- A unary call: `ok, reply, meta` or `false, err`. `request` is the message's bytes (a
--- string) or a table (with the channel's proto). The reply is a table when the channel's proto
--- knows the method (unless opts.raw), else its bytes; `meta` holds the server's `headers`
--- and `trailers`. Options: `timeout` (seconds), `metadata` ({key = value}), `wait_for_ready`,
--- `compression` (`"gzip"` or `"deflate"`: the request compressed over HTTP/2), `raw`.
function Channel:unary(path, request, opts)
    local h = self.handle
    if h == nil then
        return false, new_error(UNAVAILABLE, "the channel is closed")
    end
    local _, perr = c_string("the path", path)
    if perr then
        return false, perr
    end
    local codec = self:_codec(path, opts)
    local ok, bytes = encode(self, codec, path, request)
    if not ok then
        return false, bytes
    end
    local r
    local phase = yield_phase()
    if phase then
        local o, md = call_options(opts, (self.spin and worth_spinning(phase)) and CALL_SPIN or 0)
        if not o then
            return false, md
        end
        local q, qerr = queue()
        if not q then
            free_metadata(md)
            return false, qerr
        end
        local tag = fresh_tag()
        local rc = C.isthmus_unary_async(h, path, bytes, #bytes, o, q, tag, now, status_out)
        free_metadata(md)
        r = finish_async(rc, tag, backstop(opts))
        if r.err then
            return false, r.err
        end
    else
        local o, md = call_options(opts, 0, blocking_default())
        if not o then
            return false, md
        end
        local rc = C.isthmus_unary(h, path, bytes, #bytes, o, reply_out, headers_out, trailers_out, status_out)
        free_metadata(md)
        if rc ~= OK then
            local err = failed(rc)
            if headers_out[0] ~= nil then
                err.headers = take_metadata(headers_out[0])
            end
            return false, err
        end
        local message, merr = take_message(reply_out[0])
        r = { message = message }
        if headers_out[0] ~= nil then
            r.headers = take_metadata(headers_out[0])
        end
        if trailers_out[0] ~= nil then
            r.trailers = take_metadata(trailers_out[0])
        end
        if merr then
            merr.headers = r.headers or {}
            return false, merr
        end
    end
    local dok, reply = decode(codec, r.message or "")
    if not dok then
        return false, reply
    end
    return true, reply, { headers = r.headers or {}, trailers = r.trailers or {} }
end

--- Starts a call of any shape on `path` (client-, server- or bidirectional streaming, or a
--- unary call driven step by step): the stream, or nil, err. Options as for unary.
function Channel:stream(path, opts)
    local h = self.handle
    if h == nil then
        return nil, new_error(UNAVAILABLE, "the channel is closed")
    end
    local _, perr = c_string("the path", path)
    if perr then
        return nil, perr
    end
    -- Streams never wait on the worker's thread: each of their waits goes through the bell.
    local yields = can_yield()
    local o, md = call_options(opts, 0, not yields and blocking_default() or nil)
    if not o then
        return nil, md
    end
    local call
    if yields then
        local q, qerr = queue()
        if not q then
            free_metadata(md)
            return nil, qerr
        end
        local tag = fresh_tag()
        local rc = C.isthmus_call_start_async(h, path, o, q, tag, now, status_out)
        free_metadata(md)
        local r = finish_async(rc, tag, backstop(opts))
        if r.err then
            return nil, r.err
        end
        call = r.call
    else
        local out = ffi_new("isthmus_call_t*[1]")
        local rc = C.isthmus_call_start(h, path, o, out, status_out)
        free_metadata(md)
        if rc ~= OK then
            return nil, failed(rc)
        end
        call = ffi_gc(out[0], C.isthmus_call_free)
    end
    local st = setmetatable({
        call = call,
        channel = self,
        path = path,
        codec = self:_codec(path, opts),
        backstop = backstop(opts),
        -- Started where it could yield, with no timeout: no deadline bounds a step that a
        -- later phase makes blocking (`bounded_step`).
        unbounded = yields and not (opts and opts.timeout),
        heading = {}, -- tags of its headers() waiting on the worker's queue
        -- A method whose client sends one request (unary, server streaming), as the channel's
        -- proto says: its send half-closes, as generated clients do (a server may wait for
        -- the half-close before it answers; tonic's does).
        one_request = self.proto ~= nil and self.proto:client_streams(path) == false,
    }, Stream)
    local slot = request_owner()
    if slot then
        owned[st] = slot
        prune_soon() -- looked at within LOOK_S of its request's end, even with no call waiting
    end
    return st
end

-- The queue of the steps `step_within` makes, apart from the worker's: its waits must take
-- only their own event, and nothing the watcher hands out.
local step_q, step_event, step_now

-- The step queue, made on first use; nil, err if it cannot be. One made before a fork (in
-- nginx's master, by init_by_lua) is the parent's, which the library refuses in the worker: a
-- new one is made there.
local function step_queue()
    if step_q ~= nil and C.isthmus_cq_fd(step_q) < 0 then
        C.isthmus_cq_free(step_q) -- in a child, this only forgets it
        step_q = nil
    end
    if step_q == nil then
        local q, err = new_queue()
        if not q then
            return nil, err
        end
        step_q, step_event, step_now = q, ffi_new("isthmus_event_t[1]"), ffi_new("isthmus_event_t[1]")
    end
    return step_q
end

-- A receive with a timeout of its own where the thread blocks (a phase that cannot yield, a
-- worker thread's VM, plain LuaJIT): `start_async` on the step queue, waited for at most
-- `seconds`. Past them the operation is taken back, not the call: { timed_out = true }, and
-- the stream goes on. (A step that finished as the time ran out gives its outcome.)
local function step_within(start_async, seconds)
    local _, qerr = step_queue()
    if qerr then
        return { code = UNAVAILABLE, err = qerr }
    end
    local tag = fresh_tag()
    local done = at_once(start_async(step_q, tag, step_now), step_now)
    if done then
        return done
    end
    -- A wait may end early, with no event (an operation woken that has not finished): the
    -- library's clock says how long is left (LuaJIT has none of its own outside nginx).
    local bounded = seconds < 2^50 / 1e6
    local deadline = bounded and tonumber(C.isthmus_clock_us()) + math.ceil(seconds * 1e6)
    while true do
        local left_us = bounded and math.max(deadline - tonumber(C.isthmus_clock_us()), 0) or -1
        if tonumber(C.isthmus_cq_wait(step_q, step_event, 1, 0, left_us)) == 1 then
            local r = outcome(step_event[0]) -- frees what it holds, whoever's it is
            if tonumber(step_event[0].tag) == tag then
                return r
            end
            -- An earlier step's, given up on as it finished: not this one's.
        elseif left_us == 0 then
            break
        end
    end
    if C.isthmus_cq_cancel(step_q, tag) == NOT_FOUND then
        while tonumber(C.isthmus_cq_poll(step_q, step_event, 1)) == 1 do
            local r = outcome(step_event[0])
            if tonumber(step_event[0].tag) == tag then
                return r
            end
        end
    end
    return { timed_out = true }
end

-- A stream's step in a phase that cannot yield, on a stream that has no deadline (started with
-- no timeout where it could yield): it blocks the worker, so it gets `blocking_timeout`, as a
-- call made in such a phase does. Past it the call is cancelled (the server sees CANCELLED) and
-- the step fails DEADLINE_EXCEEDED.
local function bounded_step(self, start_async, limit)
    local r = step_within(start_async, limit)
    if r.timed_out then
        C.isthmus_call_cancel(self.call)
        local what = ("resty.isthmus: a step of a stream with no deadline blocked the worker for "
            .. "blocking_timeout (%g s) in phase %s"):format(limit, ngx.get_phase())
        return { code = DEADLINE_EXCEEDED, err = new_error(DEADLINE_EXCEEDED, what) }
    end
    return r
end

-- A stream's operation that waits: `start_async(q, tag, now)` without blocking inside nginx,
-- `blocking()` elsewhere (bounded by `blocking_timeout` in nginx if the stream has no
-- deadline). Returns the outcome table.
local function step(self, start_async, blocking)
    if self.call == nil then
        if self.failure then -- ended with its request: says so
            return { code = self.failure.code, err = self.failure }
        end
        return { code = INVALID_ARGUMENT, err = new_error(INVALID_ARGUMENT, "the stream is closed") }
    end
    if can_yield() then
        local q, qerr = queue()
        if not q then
            return { code = UNAVAILABLE, err = qerr }
        end
        local tag = fresh_tag()
        return finish_async(start_async(q, tag, now), tag, self.backstop)
    end
    local limit = self.unbounded and blocking_default()
    if limit and limit < math.huge then -- (`math.huge`: none, and no int64 microseconds)
        return bounded_step(self, start_async, limit)
    end
    return blocking()
end

--- Sends one message (a string, or a table with the channel's proto); `last` half-closes
--- after it, and so does the one request of a method whose client does not stream (the
--- channel's proto says which). ok or false, err; after the half-close, INTERNAL (as grpc-go's
--- `SendMsg` after `CloseSend`), and the stream goes on.
function Stream:send(message, last)
    -- A call known to have failed (a receive saw why) says why, where the library says only
    -- that it is over (CANCELLED, "recv gives its status"): a caller that branches on the code
    -- would take the server's PERMISSION_DENIED, or the deadline, for its own cancel.
    if self.failure then
        return false, self.failure
    end
    local ok, bytes = encode(self.channel, self.codec, self.path, message)
    if not ok then
        return false, bytes
    end
    local flag = (last or self.one_request) and 1 or 0
    local call = self.call
    local r = step(self, function(q, tag, ev)
        return C.isthmus_call_send_async(call, bytes, #bytes, flag, q, tag, ev, status_out)
    end, function()
        local rc = C.isthmus_call_send(call, bytes, #bytes, flag, status_out)
        return rc == OK and { code = OK } or { code = rc, err = failed(rc) }
    end)
    if r.err then
        return false, r.err
    end
    self.half_closed = self.half_closed or flag == 1
    return true
end

--- Half-closes the sending side: the server sees the end of the requests. ok or false, err.
--- (Writing the half-close waits while the server's ring is full: inside nginx it yields.)
function Stream:close_send()
    if self.half_closed and self.call ~= nil then
        return true -- as grpc-go's CloseSend after a CloseSend: nothing more goes
    end
    local call = self.call
    local r = step(self, function(q, tag, ev)
        return C.isthmus_call_close_send_async(call, q, tag, ev, status_out)
    end, function()
        local rc = C.isthmus_call_close_send(call)
        return rc == OK and { code = OK } or { code = rc, err = new_error(rc, "close_send failed") }
    end)
    if r.err then
        return false, r.err
    end
    self.half_closed = true
    return true
end

--- The next message: `true, message`, `true, nil` at the end of the stream (its trailers are
--- then in stream.trailers), or `false, err` when the call failed; a message this side cannot
--- take (not of the proto's type, too long for a Lua string) fails it too, cancelled.
--- `timeout` (seconds, optional) bounds this receive alone, as a cosocket's read timeout: past
--- it `false, err` with `err.code` DEADLINE_EXCEEDED and `err.timeout` true, and the stream goes
--- on (the next receive gets the next message; the call's own deadline is the `timeout` option
--- of `ch:stream`).
function Stream:recv(timeout)
    if self.failure then
        return false, self.failure
    end
    if timeout ~= nil and (type(timeout) ~= "number" or not (timeout > 0)) then
        return false, new_error(INVALID_ARGUMENT,
            "resty.isthmus: a receive's timeout is a number of seconds above 0, not " .. tostring(timeout))
    end
    local call = self.call
    local busy = self:_receiving_elsewhere()
    if busy then
        return false, busy -- the stream goes on: this receive is refused, not failed
    end
    local r
    if call == nil or not can_yield() then
        -- Closed (step says so), or where the worker cannot yield: it blocks, unless a left
        -- receive has the stream's next message.
        local blocked = call ~= nil and self:_cannot_block()
        if blocked then
            return false, blocked
        end
        local start = function(q, tag, ev)
            return C.isthmus_call_recv_async(call, q, tag, ev, status_out)
        end
        r = call ~= nil and self:_take_left()
        if not r and call ~= nil and timeout then
            -- Bounded on its own, on the step queue. On a stream with no deadline,
            -- `blocking_timeout` bounds it, as it bounds every step here (bounded_step): a
            -- longer timeout of its own does not lift it.
            local cap = self.unbounded and blocking_default()
            r = cap and cap < timeout and bounded_step(self, start, cap) or step_within(start, timeout)
        elseif not r then
            r = step(self, start, function()
                local rc = C.isthmus_call_recv(call, reply_out, status_out)
                if rc ~= OK then
                    return { code = rc, err = failed(rc) }
                end
                local message, merr = take_message(reply_out[0])
                return { code = merr and merr.code or OK, message = message, err = merr }
            end)
        end
    elseif self.left_recv and abandoned(self.left_recv.w) then
        -- A receive whose light thread went away (killed, say, to bound its wait) left its
        -- operation under way: the message it gets is the stream's next, so this receive takes
        -- it over. A new one would take the message after it, and that one would be lost.
        r = self:_wait_recv(self.left_recv.w, self.left_recv.tag, timeout)
    else
        local q, qerr = queue()
        if not q then
            return self:_failed(qerr)
        end
        local tag = fresh_tag()
        local done, w = begin_wait(C.isthmus_call_recv_async(call, q, tag, now, status_out), tag)
        r = done or self:_wait_recv(w, tag, timeout)
    end
    if r.timed_out then
        local err = new_error(DEADLINE_EXCEEDED,
            ("resty.isthmus: no message within the receive's timeout (%g s); the stream goes on"):format(timeout))
        err.timeout = true
        return false, err
    end
    if r.err then
        return self:_failed(r.err)
    end
    if r.message == nil then
        self.trailers = take_metadata(C.isthmus_call_trailers(call))
        self.ended = true
        return true, nil
    end
    local ok, reply = decode(self.codec, r.message)
    if not ok then
        return self:_failed(reply)
    end
    return true, reply
end

-- Waits, as a receive, on waiter `w` of receive operation `tag` (at most `timeout` seconds, if
-- given, after which the stream goes on), noted on the stream until it has its outcome: if
-- this light thread goes away meanwhile, the stream's next receive takes the operation over
-- (Stream:recv), and prune leaves its queued message for that one.
function Stream:_wait_recv(w, tag, timeout)
    w.stream = self
    local left = { w = w, tag = tag }
    self.left_recv = left
    local own = timeout ~= nil and timeout < self.backstop
    local r = wait_on(w, tag, own and timeout or self.backstop, own)
    w.stream = nil
    if self.left_recv == left then
        self.left_recv = nil
    end
    return r
end

-- The error for a receive while another light thread's receive waits on the stream, which
-- gets the stream's next message: one receive at a time, as a cosocket reads ("socket busy
-- reading") and as grpc-go's RecvMsg is not to be called from two goroutines. Two went on:
-- when the first one's light thread was killed, the message it was to get was lost.
function Stream:_receiving_elsewhere()
    local left = self.left_recv
    if left and not abandoned(left.w) then
        return new_error(FAILED_PRECONDITION, "resty.isthmus: another light thread is receiving on this stream")
    end
end

-- Before a receive or `headers()` blocks the worker's thread (a phase that cannot yield): a
-- `headers()` of this stream under way on the worker's queue holds the call's receiving side,
-- and only this thread moves that queue on, so the step would wait behind it for ever. One
-- whose light thread went away is cancelled; one still awaited refuses the step (an error).
function Stream:_cannot_block()
    for tag in pairs(self.heading) do
        local w = waiting[tag]
        if w and not abandoned(w) then
            return new_error(FAILED_PRECONDITION,
                "resty.isthmus: another light thread waits for this stream's headers; a phase that cannot yield cannot wait behind it")
        end
        self.heading[tag] = nil
        if w then
            if C.isthmus_cq_cancel(cq, tag) == NOT_FOUND then
                dispatch() -- it finished: its event is queued, and goes to nobody
            else
                waiting[tag] = nil
            end
            w.result = nil
        end
    end
end

-- Where a receive cannot wait on a left receive (a phase that cannot yield): the left one's
-- outcome if it has come (dispatched here if it is queued), else nil, the left one cancelled
-- so that a blocking receive takes the next message itself.
function Stream:_take_left()
    local left = self.left_recv
    if left == nil or not abandoned(left.w) then
        return nil
    end
    self.left_recv = nil
    local w = left.w
    if w.result == nil then
        if C.isthmus_cq_cancel(cq, left.tag) ~= NOT_FOUND then
            waiting[left.tag] = nil
            return nil
        end
        dispatch() -- it finished: its event is queued
    end
    w.stream = nil
    local r = w.result
    w.result = nil
    return r
end

-- A receive that failed ends the call, as any error of grpc-go's RecvMsg ends its stream: a
-- message this side cannot take (too long for a Lua string, not of the proto's type), or a
-- wait that failed here, cancels it, so the server's handler stops sending to a stream nobody
-- reads; later receives give the same error. (A cancel of a call that is over already, as
-- after the server's own status, does nothing.)
function Stream:_failed(err)
    if self.call ~= nil then
        C.isthmus_call_cancel(self.call)
    end
    if self.failure then
        -- Known already (its request ended): a receive under way then ends with the call,
        -- and its error says less.
        return false, self.failure
    end
    self.failure = err
    -- The server's trailers, if it ended the call (`{}` otherwise): stream.trailers holds
    -- them whichever way the stream ended, as grpc-go's Trailer() does.
    self.trailers = err.trailers or {}
    return false, err
end

--- The server's initial metadata (waits for it): true, {key = value} or false, err.
function Stream:headers()
    local call = self.call
    if call ~= nil and not can_yield() then
        -- A receive waiting on the worker's queue holds the receiving side too.
        local blocked = self:_cannot_block()
            or (self.left_recv and new_error(FAILED_PRECONDITION,
                "resty.isthmus: a receive waits on this stream; a phase that cannot yield cannot wait behind it"))
        if blocked then
            return false, blocked
        end
    end
    -- Noted while it waits on the worker's queue: a light thread killed meanwhile leaves it
    -- there (Stream:_cannot_block).
    local heading, noted = self.heading, nil
    local r = step(self, function(q, tag, ev)
        noted = tag
        heading[tag] = true
        return C.isthmus_call_headers_async(call, q, tag, ev, status_out)
    end, function()
        local rc = C.isthmus_call_headers(call, headers_out, status_out)
        if rc ~= OK then
            return { code = rc, err = failed(rc) }
        end
        return { code = OK, headers = take_metadata(headers_out[0]) }
    end)
    if noted then
        heading[noted] = nil
    end
    if r.err then
        return false, r.err
    end
    return true, r.headers or {}
end

--- Cancels the call: the server sees CANCELLED, and this side's waits end with it.
function Stream:cancel()
    if self.call ~= nil then
        C.isthmus_call_cancel(self.call)
    end
    return true
end

--- Frees the stream (a call still running is cancelled).
function Stream:close()
    owned[self] = nil
    local call = self.call
    if call ~= nil then
        self.call = nil
        C.isthmus_call_free(ffi_gc(call, nil))
    end
    return true
end

_M.Channel, _M.Stream, _M.Proto = Channel, Stream, Proto

return _M
