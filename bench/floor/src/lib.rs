//! The anchors `make bench` measures next to coordination-guard, each the least a filter of its
//! kind can do, so the report can say what bounds the filter's cost on this machine:
//!
//! - `wasm_floor` (plugin configuration without `callout`): per request it reads `:path` and
//!   bumps the counter `floor.requests`, nothing else. Its cost over plain Envoy is what every
//!   proxy-wasm filter pays on this Envoy (a context per stream, the V8 boundary per callback).
//! - `wasm_naive` (`{"callout": {...}}`): the same, plus one gateway callout per request that
//!   the request waits for (an `EVAL` of a one-line `INCR` through webdis), then
//!   `floor.callouts` counts the 200 answers. The naive design the issue quotes: what one
//!   callout per request costs, whatever the script does.
//!
//! - `wasm_floor_429` (`{"local_reply": {...}}`): the same, but every request is answered by
//!   the filter with the given local reply (status, headers, body): the least a filter that
//!   rejects locally pays, the anchor of the over-limit cache's rejected path.
//!
//! It ignores every host error and never panics.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType, MetricType};
use std::rc::Rc;
use std::time::Duration;

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Floor::default()) });
}}

/// Where the naive mode's callout goes.
#[derive(serde::Deserialize)]
struct Callout {
    cluster: String,
    authority: String,
    authorization: String,
    /// The webdis command, e.g. `EVAL/return%20redis.call('INCR',KEYS[1])/1/naive.raw`.
    body: String,
}

/// The local reply mode's answer.
#[derive(serde::Deserialize)]
struct LocalReply {
    status: u32,
    headers: Vec<(String, String)>,
    body: String,
}

#[derive(serde::Deserialize, Default)]
struct Settings {
    callout: Option<Callout>,
    local_reply: Option<LocalReply>,
}

/// The counters' metric ids (None if the host refused one) and the callout, shared by the root
/// and every request.
#[derive(Default, Clone)]
struct Floor {
    requests: Option<u32>,
    callouts: Option<u32>,
    callout: Option<Rc<Callout>>,
    local_reply: Option<Rc<LocalReply>>,
}

impl Context for Floor {
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, _body: usize, _tr: usize) {
        let status = hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status");
        if let (Ok(Some(s)), Some(id)) = (status, self.callouts) {
            if s == "200" {
                let _ = hostcalls::increment_metric(id, 1);
            }
        }
        let _ = hostcalls::resume_http_request();
    }
}

impl RootContext for Floor {
    fn on_configure(&mut self, size: usize) -> bool {
        if self.requests.is_none() {
            self.requests = hostcalls::define_metric(MetricType::Counter, "floor.requests").ok();
            self.callouts = hostcalls::define_metric(MetricType::Counter, "floor.callouts").ok();
        }
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size);
        let settings: Settings = match bytes {
            Ok(Some(b)) => serde_json::from_slice(&b).unwrap_or_default(),
            _ => Settings::default(),
        };
        self.callout = settings.callout.map(Rc::new);
        self.local_reply = settings.local_reply.map(Rc::new);
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(self.clone()))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

impl HttpContext for Floor {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // The SDK's get_http_request_header unwraps; the hostcall does not.
        let _ = hostcalls::get_map_value(MapType::HttpRequestHeaders, ":path");
        if let Some(id) = self.requests {
            let _ = hostcalls::increment_metric(id, 1);
        }
        if let Some(r) = &self.local_reply {
            let headers = r
                .headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_str()))
                .collect();
            let _ = hostcalls::send_http_response(r.status, headers, Some(r.body.as_bytes()));
            return Action::Pause;
        }
        let Some(c) = &self.callout else {
            return Action::Continue;
        };
        let headers = vec![
            (":method", "POST"),
            (":path", "/"),
            (":authority", c.authority.as_str()),
            ("authorization", c.authorization.as_str()),
            ("content-type", "text/plain"),
        ];
        let sent = hostcalls::dispatch_http_call(
            &c.cluster,
            headers,
            Some(c.body.as_bytes()),
            vec![],
            Duration::from_secs(1),
        );
        match sent {
            Ok(_) => Action::Pause,
            Err(_) => Action::Continue,
        }
    }
}
