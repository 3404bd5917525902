//! A small reader over `serde_json::Value` that tracks the field path, so every configuration
//! error names exactly where it is (`policies[1].rate_limits[0].window: ...`) and unknown fields
//! are refused with their path. serde's `deny_unknown_fields` cannot name the path.

use serde_json::{Map, Value};
use std::collections::BTreeSet;
use std::fmt;

/// A configuration error: the JSON path of the offending field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub problem: String,
}

impl ConfigError {
    pub fn new(path: impl Into<String>, problem: impl Into<String>) -> Self {
        ConfigError {
            path: path.into(),
            problem: problem.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.problem)
        } else {
            write!(f, "{}: {}", self.path, self.problem)
        }
    }
}

pub type Result<T> = std::result::Result<T, ConfigError>;

/// Joins a parent path and a field name the way the error messages show it.
pub fn child(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
    }
}

/// The path of element `i` of the array at `path`.
pub fn index(path: &str, i: usize) -> String {
    format!("{path}[{i}]")
}

/// One JSON object being read. Every field read is remembered; `finish` refuses the rest.
pub struct Obj<'a> {
    map: &'a Map<String, Value>,
    path: String,
    seen: BTreeSet<&'static str>,
}

impl<'a> Obj<'a> {
    pub fn new(value: &'a Value, path: &str) -> Result<Self> {
        match value {
            Value::Object(map) => Ok(Obj {
                map,
                path: path.to_string(),
                seen: BTreeSet::new(),
            }),
            other => Err(ConfigError::new(
                path,
                format!("expected an object, found {}", kind(other)),
            )),
        }
    }

    pub fn field_path(&self, field: &str) -> String {
        child(&self.path, field)
    }

    /// The raw value of `field`, if present and not null.
    pub fn get(&mut self, field: &'static str) -> Option<&'a Value> {
        self.seen.insert(field);
        match self.map.get(field) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    pub fn required(&mut self, field: &'static str) -> Result<&'a Value> {
        let path = self.field_path(field);
        self.get(field)
            .ok_or_else(|| ConfigError::new(path, "is required"))
    }

    pub fn opt_str(&mut self, field: &'static str) -> Result<Option<&'a str>> {
        let path = self.field_path(field);
        match self.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(other) => Err(ConfigError::new(
                path,
                format!("expected a string, found {}", kind(other)),
            )),
        }
    }

    pub fn req_str(&mut self, field: &'static str) -> Result<&'a str> {
        let path = self.field_path(field);
        self.opt_str(field)?
            .ok_or_else(|| ConfigError::new(path, "is required"))
    }

    pub fn opt_bool(&mut self, field: &'static str) -> Result<Option<bool>> {
        let path = self.field_path(field);
        match self.get(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(ConfigError::new(
                path,
                format!("expected true or false, found {}", kind(other)),
            )),
        }
    }

    /// A positive integer (`> 0`).
    pub fn opt_positive(&mut self, field: &'static str) -> Result<Option<u64>> {
        let path = self.field_path(field);
        match self.get(field) {
            None => Ok(None),
            Some(v) => positive(v, &path).map(Some),
        }
    }

    pub fn opt_array(&mut self, field: &'static str) -> Result<Option<&'a Vec<Value>>> {
        let path = self.field_path(field);
        match self.get(field) {
            None => Ok(None),
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(other) => Err(ConfigError::new(
                path,
                format!("expected an array, found {}", kind(other)),
            )),
        }
    }

    /// An optional array of strings, each checked by `check` (which gets the element's path).
    pub fn opt_str_list(&mut self, field: &'static str) -> Result<Option<Vec<&'a str>>> {
        let path = self.field_path(field);
        let Some(items) = self.opt_array(field)? else {
            return Ok(None);
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match item {
                Value::String(s) => out.push(s.as_str()),
                other => {
                    return Err(ConfigError::new(
                        index(&path, i),
                        format!("expected a string, found {}", kind(other)),
                    ))
                }
            }
        }
        Ok(Some(out))
    }

    /// Refuses any field that was not read.
    pub fn finish(self) -> Result<()> {
        for key in self.map.keys() {
            if !self.seen.contains(key.as_str()) {
                let known: Vec<&str> = self.seen.iter().copied().collect();
                return Err(ConfigError::new(
                    child(&self.path, key),
                    format!("unknown field (known here: {})", known.join(", ")),
                ));
            }
        }
        Ok(())
    }
}

fn positive(v: &Value, path: &str) -> Result<u64> {
    match v.as_u64() {
        Some(n) if n > 0 => Ok(n),
        _ => Err(ConfigError::new(
            path,
            format!("{v} is not a positive integer (must be > 0)"),
        )),
    }
}

pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
