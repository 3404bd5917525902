//! A streaming reader of an event stream (`text/event-stream`), by the parsing rules of the
//! WHATWG HTML standard's server-sent events: fed the stream in pieces as they pass, it hands
//! each event's data to an [`Events`] sink as it arrives and says when the event is complete.
//! It keeps nothing of the stream: its memory is the size of [`EventStream`] (a few bytes),
//! however long a line, an event or the stream is, so a reader of the data (such as a JSON
//! scan) that keeps nothing either reads an endless stream in constant memory.
//!
//! The rules it follows: a line ends at CR, LF or CRLF (a CRLF split between two pieces is one
//! line end); a line starting with `:` is a comment; `name: value` is a field, one space after
//! the colon dropped, and a line without a colon is a field with an empty value; only the
//! field named exactly `data` carries data, and an event's `data` lines are joined with LF; a
//! blank line ends the event, which is dispatched if it had a `data` line; one UTF-8 byte
//! order mark at the stream's start is skipped; an event the stream ends in the middle of is
//! never dispatched. Other fields (`event`, `id`, `retry`) are read past.

/// Where the reader is in the current line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// At a line's first byte.
    Start,
    /// In a field's name: how many bytes of `data` it matched so far, or `None` once it
    /// differs.
    Name(Option<u8>),
    /// Right after the colon: a space here is not part of the value.
    ValueStart { data: bool },
    /// In the value (or a comment, which is not data), up to the line's end.
    Value { data: bool },
}

/// The byte order mark skipped at the stream's start.
const BOM: &[u8] = b"\xEF\xBB\xBF";
const DATA: &[u8] = b"data";

/// What a reader of the stream is told as it passes.
pub(crate) trait Events {
    /// The next bytes of the current event's data (its `data` lines joined with LF), in order.
    fn data(&mut self, bytes: &[u8]);
    /// The current event is complete (and had data): it is dispatched. The next data is the
    /// next event's.
    fn dispatch(&mut self);
}

/// The reader's state between pieces (see the module's documentation).
#[derive(Debug, Clone)]
pub(crate) struct EventStream {
    line: Line,
    /// Bytes of the byte order mark matched at the stream's start; `None` once past it.
    bom: Option<u8>,
    /// The last line ended with CR: an LF right after it ends nothing.
    after_cr: bool,
    /// Whether the current event has a `data` line yet.
    has_data: bool,
}

impl Default for EventStream {
    fn default() -> EventStream {
        EventStream::new()
    }
}

impl EventStream {
    pub(crate) fn new() -> EventStream {
        EventStream {
            line: Line::Start,
            bom: Some(0),
            after_cr: false,
            has_data: false,
        }
    }

    /// The next piece of the stream.
    pub(crate) fn feed(&mut self, bytes: &[u8], sink: &mut impl Events) {
        let mut i = 0;
        while let Some(&b) = bytes.get(i) {
            if let Some(at) = self.bom {
                if BOM.get(usize::from(at)) == Some(&b) {
                    self.bom = (usize::from(at) + 1 < BOM.len()).then_some(at + 1);
                    i += 1;
                    continue;
                }
                self.bom = None;
                if at > 0 {
                    // Part of a byte order mark, then something else: a field name that is
                    // not `data`.
                    self.line = Line::Name(None);
                }
            }
            if std::mem::take(&mut self.after_cr) && b == b'\n' {
                i += 1;
                continue;
            }
            if let Line::Value { data } = self.line {
                // The rest of the value, up to the line's end, in one piece.
                let rest = bytes.get(i..).unwrap_or_default();
                let len = rest
                    .iter()
                    .position(|&c| c == b'\r' || c == b'\n')
                    .unwrap_or(rest.len());
                if data && len > 0 {
                    sink.data(rest.get(..len).unwrap_or_default());
                }
                i += len;
                // The line's end, if this piece holds it.
                let Some(&end) = bytes.get(i) else {
                    return;
                };
                self.byte(end, sink);
                i += 1;
                continue;
            }
            self.byte(b, sink);
            i += 1;
        }
    }

    /// One byte outside a value's run.
    fn byte(&mut self, b: u8, sink: &mut impl Events) {
        if b == b'\r' || b == b'\n' {
            self.after_cr = b == b'\r';
            return self.line_end(sink);
        }
        self.line = match self.line {
            Line::Start if b == b':' => Line::Value { data: false },
            Line::Start => Line::Name(name_byte(Some(0), b)),
            Line::Name(at) if b == b':' => {
                let data = at.is_some_and(|n| usize::from(n) == DATA.len());
                if data {
                    self.data_line(sink);
                }
                Line::ValueStart { data }
            }
            Line::Name(at) => Line::Name(name_byte(at, b)),
            Line::ValueStart { data } if b == b' ' => Line::Value { data },
            Line::ValueStart { data } | Line::Value { data } => {
                if data {
                    sink.data(std::slice::from_ref(&b));
                }
                Line::Value { data }
            }
        };
    }

    /// A line ended: a blank one dispatches the event, a `data` without a colon is a data
    /// line with an empty value.
    fn line_end(&mut self, sink: &mut impl Events) {
        match self.line {
            Line::Start if self.has_data => {
                self.has_data = false;
                sink.dispatch();
            }
            Line::Name(Some(at)) if usize::from(at) == DATA.len() => self.data_line(sink),
            _ => {}
        }
        self.line = Line::Start;
    }

    /// A `data` line starts: after the event's first, the lines are joined with LF.
    fn data_line(&mut self, sink: &mut impl Events) {
        if self.has_data {
            sink.data(b"\n");
        }
        self.has_data = true;
    }
}

/// A field name's next byte, compared with `data`.
fn name_byte(at: Option<u8>, b: u8) -> Option<u8> {
    let at = at?;
    (DATA.get(usize::from(at)) == Some(&b)).then_some(at + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    /// The events as a sink sees them: the data of each one dispatched.
    #[derive(Default)]
    struct Seen {
        current: Vec<u8>,
        events: Vec<String>,
    }

    impl Events for Seen {
        fn data(&mut self, bytes: &[u8]) {
            self.current.extend_from_slice(bytes);
        }
        fn dispatch(&mut self) {
            let data = std::mem::take(&mut self.current);
            self.events
                .push(String::from_utf8_lossy(&data).into_owned());
        }
    }

    fn read(pieces: &[&[u8]]) -> Vec<String> {
        let mut s = EventStream::new();
        let mut seen = Seen::default();
        for p in pieces {
            s.feed(p, &mut seen);
        }
        seen.events
    }

    /// The stream read whole, in every split into two pieces, and byte by byte: one answer.
    fn every_split(stream: &[u8]) -> Vec<String> {
        let whole = read(&[stream]);
        for cut in 0..=stream.len() {
            let (a, b) = stream.split_at(cut);
            assert_eq!(read(&[a, b]), whole, "cut at {cut} of {stream:?}");
        }
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(read(&bytes), whole, "byte by byte: {stream:?}");
        whole
    }

    #[test]
    fn events_and_their_data_lines() {
        for (stream, want) in [
            (&b"data: a\n\n"[..], vec!["a"]),
            (b"data: a\ndata: b\n\n", vec!["a\nb"]),
            (b"data:a\r\ndata:  b\r\n\r\n", vec!["a\n b"]),
            (b"data: a\rdata: b\r\rdata: c\n\n", vec!["a\nb", "c"]),
            (b"data\n\n", vec![""]),
            (b"data\ndata\n\n", vec!["\n"]),
            (b"data:\n\n", vec![""]),
            (b": a comment\ndata: x\n: another\n\n", vec!["x"]),
            (b"event: usage\nid: 7\nretry: 10\ndata: x\n\n", vec!["x"]),
            // No data: nothing dispatched.
            (b"event: ping\n\n: keep-alive\n\n\n\n", vec![]),
            // Only the field named exactly `data`.
            (
                b"Data: no\ndatum: no\ndata2: no\n data: no\ndat: no\ndata: yes\n\n",
                vec!["yes"],
            ),
            // A colon in the value is the value's.
            (b"data: {\"a\": 1}\n\n", vec!["{\"a\": 1}"]),
            // OpenAI's sentinel is an event like any other.
            (
                b"data: {\"usage\":null}\n\ndata: [DONE]\n\n",
                vec!["{\"usage\":null}", "[DONE]"],
            ),
            // The stream ends in the middle of an event: not dispatched.
            (b"data: a\n\ndata: b\n", vec!["a"]),
            (b"data: a\n\ndata: b", vec!["a"]),
            (b"data: a\n\nevent: x\n", vec!["a"]),
            // One byte order mark at the start is skipped; anywhere else it is a name byte.
            (b"\xEF\xBB\xBFdata: a\n\n", vec!["a"]),
            (b"\xEF\xBB\xBF\xEF\xBB\xBFdata: a\n\n", vec![]),
            (b"\xEF\xBBdata: a\n\ndata: b\n\n", vec!["b"]),
            (b"data: a\n\n\xEF\xBB\xBFdata: b\n\n", vec!["a"]),
        ] {
            assert_eq!(
                every_split(stream),
                want,
                "{:?}",
                String::from_utf8_lossy(stream)
            );
        }
    }

    #[test]
    fn a_long_value_arrives_in_runs_and_nothing_is_kept() {
        let mut stream = b"data: ".to_vec();
        stream.extend(std::iter::repeat_n(b'x', 100_000));
        stream.extend_from_slice(b"\n\n");
        let mut s = EventStream::new();
        let mut seen = Seen::default();
        for piece in stream.chunks(4096) {
            s.feed(piece, &mut seen);
        }
        assert_eq!(seen.events.len(), 1);
        assert_eq!(seen.events[0].len(), 100_000);
        assert!(std::mem::size_of::<EventStream>() <= 8);
    }
}
