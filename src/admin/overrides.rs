//! `cg-admin override set|clear|list`: a tenant's or a principal's own limit.

use crate::admin::{AdminError, Context, Report};

/// Runs `override` with its own arguments.
pub(crate) fn run(_ctx: &mut Context, _args: &[String]) -> Result<Report, AdminError> {
    Err(AdminError::Usage("override: not built yet".into()))
}
