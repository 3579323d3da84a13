//! Small checks every config section uses, so each part validates its own section
//! without importing the process-wide config (which composes the sections).

pub fn positive(errs: &mut Vec<String>, key: &str, v: u64) {
    if v == 0 {
        errs.push(format!("{key}: must be greater than 0"));
    }
}

/// `host:port` with a numeric port; the host may be a name (resolved when used).
pub fn check_addr(errs: &mut Vec<String>, key: &str, v: &str) {
    let ok = v
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
    if !ok {
        errs.push(format!("{key}: {v:?} is not HOST:PORT"));
    }
}
