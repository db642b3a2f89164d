//! What the sidecar does, the same whatever carries the request: check the caller, parse the
//! JSON body, answer with JSON.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The caller, as the gateway resolved it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Auth {
    pub subject: String,
    pub scopes: Vec<String>,
    pub tenant: String,
    pub expires_at_unix_ms: i64,
}

/// One request the gateway hands over.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub query: String,
    pub headers: HashMap<String, String>,
    pub body: Value,
    pub auth: Auth,
    pub session_id: String,
}

/// The answer: an HTTP-style status, headers, a JSON body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Response {
    pub status: u32,
    pub headers: HashMap<String, String>,
    pub body: Value,
}

const SCOPE: &str = "tools:invoke";

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn refused(request: &Request) -> Option<Response> {
    let (status, error) = if request.auth.expires_at_unix_ms < now_ms() {
        (401, "the caller's credentials expired")
    } else if !request.auth.scopes.iter().any(|s| s == SCOPE) {
        (403, "the caller lacks the tools:invoke scope")
    } else {
        return None;
    };
    Some(Response { status, headers: HashMap::new(), body: json!({ "error": error }) })
}

/// `Invoke`: the body echoed inside a JSON envelope that says who asked for what.
pub fn invoke(request: &Request) -> Response {
    if let Some(refusal) = refused(request) {
        return refusal;
    }
    let headers = HashMap::from([
        ("content-type".to_owned(), "application/json".to_owned()),
        ("x-tenant".to_owned(), request.auth.tenant.clone()),
    ]);
    let body = json!({
        "ok": true,
        "subject": request.auth.subject,
        "tenant": request.auth.tenant,
        "method": request.method,
        "path": request.path,
        "query": request.query,
        "echo": request.body,
    });
    Response { status: 200, headers, body }
}

/// `InvokeStream`: `chunks=N` in the query (default 4, at most 64) JSON chunks; the status goes
/// with the last.
pub fn invoke_stream(request: &Request) -> (u32, Vec<Value>) {
    if let Some(refusal) = refused(request) {
        return (refusal.status, vec![refusal.body]);
    }
    let n = request
        .query
        .split('&')
        .find_map(|kv| kv.strip_prefix("chunks="))
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(4)
        .clamp(1, 64);
    let chunks =
        (0..n).map(|seq| json!({ "seq": seq, "of": n, "path": request.path, "tenant": request.auth.tenant })).collect();
    (200, chunks)
}

/// `CloseSession`: whether there was a session to close.
pub fn close_session(session_id: &str) -> bool {
    !session_id.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> Request {
        Request {
            path: "/tools/search".into(),
            body: json!({"q": "x"}),
            auth: Auth {
                scopes: vec![SCOPE.into()],
                tenant: "t1".into(),
                expires_at_unix_ms: i64::MAX,
                ..Auth::default()
            },
            ..Request::default()
        }
    }

    #[test]
    fn invoke_echoes_the_body_for_an_authorised_caller() {
        let r = invoke(&request());
        assert_eq!((r.status, &r.body["echo"]["q"], &r.body["tenant"]), (200, &json!("x"), &json!("t1")));
    }

    #[test]
    fn expired_or_unscoped_callers_are_refused() {
        let mut expired = request();
        expired.auth.expires_at_unix_ms = 0;
        assert_eq!(invoke(&expired).status, 401);
        let mut unscoped = request();
        unscoped.auth.scopes.clear();
        assert_eq!(invoke(&unscoped).status, 403);
    }

    #[test]
    fn streams_have_the_asked_number_of_chunks() {
        let mut r = request();
        r.query = "chunks=7".into();
        assert_eq!(invoke_stream(&r).1.len(), 7);
    }
}
