//! A command's options: `--name value` and `--flag`, each command saying which it takes. An
//! option given twice where one is expected is refused (which one counts would be a guess).

use crate::admin::AdminError;

/// The options of one command, parsed against what it accepts.
#[derive(Debug, Default)]
pub(crate) struct Args {
    values: Vec<(String, String)>,
    flags: Vec<String>,
}

impl Args {
    /// `valued`: options that take a value (`--tenant acme` or `--tenant=acme`); `flags`:
    /// options that take none. Anything else is a usage error naming it.
    pub(crate) fn parse(
        args: &[String],
        valued: &[&str],
        flags: &[&str],
    ) -> Result<Args, AdminError> {
        let mut out = Args::default();
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let (name, inline) = match arg.split_once('=') {
                Some((n, v)) if n.starts_with("--") => (n, Some(v.to_string())),
                _ => (arg.as_str(), None),
            };
            if valued.contains(&name) {
                let value = match inline {
                    Some(v) => v,
                    None => it
                        .next()
                        .cloned()
                        .ok_or_else(|| AdminError::Usage(format!("{name} needs a value")))?,
                };
                out.values.push((name.to_string(), value));
            } else if flags.contains(&name) && inline.is_none() {
                out.flags.push(name.to_string());
            } else {
                let mut known: Vec<&str> = valued.iter().chain(flags).copied().collect();
                known.sort_unstable();
                return Err(AdminError::Usage(format!(
                    "unknown option {arg:?}; this command takes {}",
                    known.join(", ")
                )));
            }
        }
        Ok(out)
    }

    /// The value of an option given at most once.
    pub(crate) fn value(&self, name: &str) -> Result<Option<&str>, AdminError> {
        let mut found = self.values.iter().filter(|(n, _)| n == name);
        let first = found.next().map(|(_, v)| v.as_str());
        if found.next().is_some() {
            return Err(AdminError::Usage(format!("{name} is given more than once")));
        }
        Ok(first)
    }

    /// The value of an option that must be given once.
    pub(crate) fn required(&self, name: &str) -> Result<&str, AdminError> {
        self.value(name)?
            .ok_or_else(|| AdminError::Usage(format!("{name} is required")))
    }

    /// Every value of an option that may repeat (`--header`), in order.
    pub(crate) fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.values
            .iter()
            .filter(move |(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn flag(&self, name: &str) -> bool {
        self.flags.iter().any(|f| f == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn options_are_read_and_checked() {
        let a = Args::parse(
            &strings(&[
                "--tenant",
                "acme",
                "--header=x-a: 1",
                "--header",
                "x-b: 2",
                "--reset",
            ]),
            &["--tenant", "--header"],
            &["--reset"],
        )
        .unwrap();
        assert_eq!(a.value("--tenant").unwrap(), Some("acme"));
        assert_eq!(
            a.values("--header").collect::<Vec<_>>(),
            ["x-a: 1", "x-b: 2"]
        );
        assert!(a.flag("--reset"));
        assert!(a.value("--header").is_err(), "one of two is a guess");
        assert!(a.required("--principal").is_err());
        let err = Args::parse(&strings(&["--tenat", "x"]), &["--tenant"], &[]).unwrap_err();
        assert!(err.to_string().contains("--tenat"), "{err}");
        assert!(Args::parse(&strings(&["--tenant"]), &["--tenant"], &[]).is_err());
        assert!(Args::parse(&strings(&["--reset=1"]), &[], &["--reset"]).is_err());
    }
}
