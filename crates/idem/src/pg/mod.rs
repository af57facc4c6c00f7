//! PostgreSQL, as a merge target and a verify target: connections (libpq URLs and
//! environment, TLS by rustls), the mapping between Arrow and PostgreSQL types
//! ([`types`]), and binary `COPY` in both directions ([`copy`]).
//!
//! A connection is made the way `psql` makes it: the URL's parts first, then `PGHOST`,
//! `PGPORT`, `PGUSER`, `PGPASSWORD`, `PGDATABASE`, `PGSSLMODE`, `PGSSLROOTCERT`,
//! `PGCONNECT_TIMEOUT` and `PGAPPNAME` for what it leaves out. The password never leaves
//! this module: messages name the server by [`Database::display`], which has none.

#[cfg(feature = "postgres")]
mod connect;
#[cfg(feature = "postgres")]
pub(crate) mod copy;
#[cfg(feature = "postgres")]
pub(crate) mod table;
#[cfg(feature = "postgres")]
mod tls;
#[cfg(feature = "postgres")]
pub(crate) mod types;

#[cfg(feature = "postgres")]
pub(crate) use connect::{Database, Settings, TableName, describe, is_retryable, literal, quote};

/// Whether `location` names a PostgreSQL database rather than a table on storage.
pub(crate) fn is_postgres_url(location: &str) -> bool {
    let lower = location.get(..13).unwrap_or(location).to_ascii_lowercase();
    lower.starts_with("postgres://") || lower.starts_with("postgresql://")
}

/// `location` with any password in it left out (after the user, or a `password=`
/// parameter), for messages and labels.
pub fn redact_location(location: &str) -> String {
    let Some(scheme_end) = location.find("://") else {
        return location.to_owned();
    };
    let rest = &location[scheme_end + 3..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rfind('@') {
        Some(at) => {
            let user = authority[..at].split(':').next().unwrap_or_default();
            format!("{user}@{}", &authority[at + 1..])
        }
        None => authority.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let kept: Vec<&str> = query
                .split('&')
                .filter(|pair| !pair.to_ascii_lowercase().starts_with("password="))
                .collect();
            if kept.is_empty() {
                path.to_owned()
            } else {
                format!("{path}?{}", kept.join("&"))
            }
        }
        None => tail.to_owned(),
    };
    format!("{}://{authority}{tail}", &location[..scheme_end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_left_out_of_locations() {
        assert_eq!(
            redact_location("postgres://u:hunter2@h:1/db"),
            "postgres://u@h:1/db"
        );
        assert_eq!(
            redact_location("postgresql://h/db?sslmode=require&password=hunter2"),
            "postgresql://h/db?sslmode=require"
        );
        assert_eq!(
            redact_location("postgres://h/db?password=x"),
            "postgres://h/db"
        );
        assert_eq!(redact_location("s3://bucket/t"), "s3://bucket/t");
        assert!(is_postgres_url("PostgreSQL://x/y") && !is_postgres_url("s3://b/t"));
    }
}
