//! A small reader over `serde_json::Value` that tracks the field path, so every configuration
//! error names exactly where it is (`policies[1].rate_limits[0].window: ...`) and unknown fields
//! are refused with their path, first, with the known name a misspelling was meant as.
//! serde's `deny_unknown_fields` cannot name the path.

use serde_json::{Map, Value};
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

/// One JSON object being read, with the fields it may have: any other field is refused when
/// it is opened, before a field is read, so a misspelt field is reported as unknown (with the
/// known name nearest to it) rather than as a required one missing.
pub struct Obj<'a> {
    map: &'a Map<String, Value>,
    path: String,
    #[cfg(test)]
    known: &'static [&'static str],
}

impl<'a> Obj<'a> {
    /// The object at `path`, whose fields must be among `known`.
    pub fn new(value: &'a Value, path: &str, known: &'static [&'static str]) -> Result<Self> {
        match value {
            Value::Object(map) => {
                if let Some(field) = map.keys().find(|k| !known.contains(&k.as_str())) {
                    return Err(unknown_field(path, field, known));
                }
                Ok(Obj {
                    map,
                    path: path.to_string(),
                    #[cfg(test)]
                    known,
                })
            }
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
        // Every field read must be declared known, else a config using it would be refused.
        #[cfg(test)]
        assert!(
            self.known.contains(&field),
            "{}: {field} is read but not among the known fields",
            self.path
        );
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
}

/// The error of a field not among `known`: the nearest known name when one is close enough to
/// be a misspelling of it, else every known name.
fn unknown_field(path: &str, field: &str, known: &[&str]) -> ConfigError {
    let problem = match nearest(field, known) {
        Some(name) => format!("unknown field (did you mean `{name}`?)"),
        None => {
            let mut names = known.to_vec();
            names.sort_unstable();
            format!("unknown field (known here: {})", names.join(", "))
        }
    };
    ConfigError::new(child(path, field), problem)
}

/// The name of `known` nearest to `given` by edit distance (insertions, deletions,
/// substitutions and swaps of adjacent characters, ignoring case), when it is at most 2 edits
/// and at most a third of `given`'s length (at least 1) away; the first such name on a tie.
pub fn nearest<'k>(given: &str, known: &[&'k str]) -> Option<&'k str> {
    let len = given.chars().count();
    let most = (len / 3).clamp(1, 2);
    known
        .iter()
        .filter_map(|name| Some((edit_distance(given, name, most)?, *name)))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, name)| name)
}

/// The optimal-string-alignment distance between `a` and `b`, case-insensitive, if it is at
/// most `most`.
fn edit_distance(a: &str, b: &str, most: usize) -> Option<usize> {
    let a: Vec<char> = a.chars().map(|c| c.to_ascii_lowercase()).collect();
    let b: Vec<char> = b.chars().map(|c| c.to_ascii_lowercase()).collect();
    if a.len().abs_diff(b.len()) > most {
        return None;
    }
    // Three rows of the table: i-2, i-1 and i.
    let mut before: Vec<usize> = vec![0; b.len() + 1];
    let mut last: Vec<usize> = (0..=b.len()).collect();
    let mut row: Vec<usize> = vec![0; b.len() + 1];
    for i in 1..=a.len() {
        row[0] = i;
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut d = (last[j] + 1).min(row[j - 1] + 1).min(last[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d = d.min(before[j - 2] + 1);
            }
            row[j] = d;
        }
        std::mem::swap(&mut before, &mut last);
        std::mem::swap(&mut last, &mut row);
    }
    let distance = last[b.len()];
    (distance <= most).then_some(distance)
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
