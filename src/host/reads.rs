//! The host's side of a request's headers ([`HostReads`]) through the SDK, each part of
//! reading them timed as its span (`make bench-spans`).

use super::sdk::{self, MapType};
use super::spans::{self, Span};
use super::{header_map, property};
use crate::http::arrival::{HostReads, Part};
use crate::http::headers::Headers;

/// The effective context's request, read from the host.
pub(super) struct SdkReads;

impl HostReads for SdkReads {
    fn request_headers(&mut self) -> Headers {
        header_map(MapType::HttpRequestHeaders)
    }

    fn remove_request_header(&mut self, name: &str) {
        let _ = sdk::remove_header(MapType::HttpRequestHeaders, name);
    }

    fn source_address(&mut self) -> Option<String> {
        property(&["source", "address"])
    }

    fn metadata(&mut self) -> Vec<u8> {
        sdk::property(&["metadata"]).unwrap_or_default()
    }

    fn timed<T>(&mut self, part: Part, f: impl FnOnce(&mut Self) -> T) -> T {
        let began = spans::mark();
        let out = f(self);
        began.end(match part {
            Part::Map => Span::HeadersMap,
            Part::Match => Span::HeadersMatch,
            Part::Parse => Span::HeadersParse,
        });
        out
    }
}
