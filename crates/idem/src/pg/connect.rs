//! Connections: settings from a URL and the libpq environment, and one open client.

use std::time::Duration;

use tokio::runtime::Runtime;
use tokio_postgres::{Client, Config, NoTls};
use url::Url;

use super::{redact_location, tls};
use crate::error::{Error, Result};

/// How the connection is secured, as libpq's `sslmode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS where the server offers it, unverified (libpq's default).
    Prefer,
    /// TLS, the certificate unverified (verified as `verify-ca` with a root certificate).
    Require,
    /// TLS, the certificate chain verified.
    VerifyCa,
    /// TLS, the chain and the host name verified.
    VerifyFull,
}

impl SslMode {
    fn parse(text: &str) -> Result<Self> {
        Ok(match text {
            "disable" | "allow" => Self::Disable,
            "prefer" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "sslmode '{other}' is not one of disable, allow, prefer, require, verify-ca, verify-full"
                )));
            }
        })
    }
}

/// Where and how to connect, with the password kept out of every message.
#[derive(Clone)]
pub(crate) struct Settings {
    host: String,
    port: u16,
    user: String,
    password: Option<String>,
    database: String,
    ssl_mode: SslMode,
    root_cert: Option<String>,
    connect_timeout: Duration,
    application_name: String,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.display())
    }
}

impl Settings {
    /// Reads a `postgres://` / `postgresql://` URL, filling what it leaves out from the
    /// libpq environment through `env`.
    pub(crate) fn parse(location: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let invalid =
            |why: String| Error::InvalidArgument(format!("{}: {why}", redact_location(location)));
        let url = Url::parse(location).map_err(|e| invalid(e.to_string()))?;
        let decode =
            |s: &str| percent_decode(s).ok_or_else(|| invalid("bad percent-encoding".to_owned()));
        let env = |name: &str| env(name).filter(|v| !v.is_empty());
        let mut ssl_mode = None;
        let mut root_cert = None;
        let mut connect_timeout = None;
        let mut application_name = None;
        let mut host = url.host_str().filter(|h| !h.is_empty()).map(str::to_owned);
        let mut port = url.port();
        let mut user = Some(decode(url.username())?).filter(|u| !u.is_empty());
        let mut password = url.password().map(decode).transpose()?;
        for (key, value) in url.query_pairs() {
            let value = value.into_owned();
            match key.as_ref() {
                "sslmode" => ssl_mode = Some(SslMode::parse(&value)?),
                "sslrootcert" => root_cert = Some(value),
                "connect_timeout" => connect_timeout = Some(value),
                "application_name" => application_name = Some(value),
                "host" => host = Some(value),
                "port" => {
                    port = Some(
                        value
                            .parse()
                            .map_err(|_| invalid(format!("bad port '{value}'")))?,
                    )
                }
                "user" => user = Some(value),
                "password" => password = Some(value),
                other => return Err(invalid(format!("unknown connection parameter '{other}'"))),
            }
        }
        let path = decode(url.path().trim_start_matches('/'))?;
        let user = user
            .or_else(|| env("PGUSER"))
            .or_else(|| env("USER"))
            .or_else(|| env("LOGNAME"))
            .unwrap_or_else(|| "postgres".to_owned());
        let database = Some(path)
            .filter(|p| !p.is_empty())
            .or_else(|| env("PGDATABASE"))
            .unwrap_or_else(|| user.clone());
        let host = host.or_else(|| env("PGHOST")).unwrap_or_else(|| {
            // libpq's default is the local socket directory, where there is one.
            if std::path::Path::new("/var/run/postgresql/.s.PGSQL.5432").exists() {
                "/var/run/postgresql".to_owned()
            } else {
                "localhost".to_owned()
            }
        });
        let port = match port {
            Some(port) => port,
            None => match env("PGPORT") {
                Some(p) => p
                    .parse()
                    .map_err(|_| invalid(format!("PGPORT '{p}' is not a port")))?,
                None => 5432,
            },
        };
        let ssl_mode = match ssl_mode {
            Some(mode) => mode,
            None => env("PGSSLMODE").map_or(Ok(SslMode::Prefer), |m| SslMode::parse(&m))?,
        };
        let timeout = connect_timeout.or_else(|| env("PGCONNECT_TIMEOUT"));
        let connect_timeout = match timeout {
            Some(t) => Duration::from_secs(
                t.parse::<u64>()
                    .map_err(|_| invalid(format!("connect_timeout '{t}' is not whole seconds")))?
                    .max(2),
            ),
            None => Duration::from_secs(30),
        };
        Ok(Self {
            host,
            port,
            user,
            password: password.or_else(|| env("PGPASSWORD")),
            database,
            ssl_mode,
            root_cert: root_cert.or_else(|| env("PGSSLROOTCERT")),
            connect_timeout,
            application_name: application_name
                .or_else(|| env("PGAPPNAME"))
                .unwrap_or_else(|| "idem".to_owned()),
        })
    }

    /// What TLS checks of the server's certificate, as libpq does for the mode: a root
    /// certificate file makes `require` check the chain.
    fn checks(&self) -> tls::Checks {
        let given_root = self.root_cert.as_deref().is_some_and(|r| r != "system");
        match self.ssl_mode {
            SslMode::Disable | SslMode::Prefer => tls::Checks::None,
            SslMode::Require if !given_root => tls::Checks::None,
            SslMode::Require | SslMode::VerifyCa => tls::Checks::Chain,
            SslMode::VerifyFull => tls::Checks::Full,
        }
    }

    /// The server and database as a URL without the password.
    pub(crate) fn display(&self) -> String {
        let host = if self.host.contains(':') && !self.host.starts_with('[') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        format!(
            "postgres://{}@{}:{}/{}",
            self.user, host, self.port, self.database
        )
    }
}

/// Percent-decoding of a URL part.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// One open connection, with the runtime that drives it: the merge and verify are
/// synchronous, and every call into the client blocks on this runtime.
pub(crate) struct Database {
    runtime: Runtime,
    client: Client,
    display: String,
}

impl Database {
    /// Connects as `settings` say.
    ///
    /// # Errors
    /// An unreachable server, refused credentials, a TLS failure: one line naming the
    /// server (never the password).
    pub(crate) fn connect(settings: &Settings) -> Result<Self> {
        let display = settings.display();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::Postgres {
                target: display.clone(),
                message: format!("cannot start the I/O runtime: {e}"),
            })?;
        let mut config = Config::new();
        config
            .host(&settings.host)
            .port(settings.port)
            .user(&settings.user)
            .dbname(&settings.database)
            .application_name(&settings.application_name)
            .connect_timeout(settings.connect_timeout)
            .ssl_mode(match settings.ssl_mode {
                SslMode::Disable => tokio_postgres::config::SslMode::Disable,
                SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
                _ => tokio_postgres::config::SslMode::Require,
            });
        if let Some(password) = &settings.password {
            config.password(password);
        }
        let failed = |e: tokio_postgres::Error| Error::Postgres {
            target: display.clone(),
            message: describe(&e),
        };
        let client = runtime.block_on(async {
            if settings.ssl_mode == SslMode::Disable || settings.host.starts_with('/') {
                let (client, connection) = config.connect(NoTls).await.map_err(failed)?;
                tokio::spawn(async move { drop(connection.await) });
                Ok::<_, Error>(client)
            } else {
                let tls = tls::connector(settings.checks(), settings.root_cert.as_deref())
                    .map_err(|message| Error::Postgres {
                        target: display.clone(),
                        message,
                    })?;
                let (client, connection) = config.connect(tls).await.map_err(failed)?;
                tokio::spawn(async move { drop(connection.await) });
                Ok(client)
            }
        })?;
        Ok(Self {
            runtime,
            client,
            display,
        })
    }

    /// The server and database, without the password.
    pub(crate) fn display(&self) -> &str {
        &self.display
    }

    /// The client, for statements run with [`Database::block_on`].
    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    /// Drives `work` (statements of [`Database::client`]) to completion.
    pub(crate) fn block_on<F: std::future::Future>(&self, work: F) -> F::Output {
        self.runtime.block_on(work)
    }

    /// Runs `work` against the client, its errors as idem's.
    pub(crate) fn run<'a, T, F>(&'a self, work: impl FnOnce(&'a Client) -> F) -> Result<T>
    where
        F: std::future::Future<Output = std::result::Result<T, tokio_postgres::Error>>,
    {
        self.runtime
            .block_on(work(&self.client))
            .map_err(|e| self.error(&e))
    }

    /// Runs statements separated by `;`, without parameters or results.
    pub(crate) fn execute_batch(&self, sql: &str) -> Result<()> {
        self.runtime
            .block_on(self.client.batch_execute(sql))
            .map_err(|e| self.error(&e))
    }

    /// A client error as idem's, naming the server.
    pub(crate) fn error(&self, e: &tokio_postgres::Error) -> Error {
        Error::Postgres {
            target: self.display.clone(),
            message: describe(e),
        }
    }
}

/// A client error in one line: the server's message with its detail and hint, or the
/// connection failure.
pub(crate) fn describe(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut text = db.message().to_owned();
        if let Some(detail) = db.detail() {
            text.push_str(&format!(" ({detail})"));
        }
        if let Some(hint) = db.hint() {
            text.push_str(&format!("; hint: {hint}"));
        }
        return text.replace('\n', " ");
    }
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(&format!(": {cause_text}"));
        }
        source = cause.source();
    }
    text.replace('\n', " ")
}

/// Whether an error is one a retry may cure: a serialization failure or a deadlock.
pub(crate) fn is_retryable(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    e.code().is_some_and(|c| {
        *c == SqlState::T_R_SERIALIZATION_FAILURE || *c == SqlState::T_R_DEADLOCK_DETECTED
    })
}

/// An SQL identifier, quoted.
pub(crate) fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// An SQL string literal.
pub(crate) fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// A `[SCHEMA.]NAME` table name; the schema is the connection's current one when absent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TableName {
    /// The schema, if named.
    pub schema: Option<String>,
    /// The table.
    pub name: String,
}

impl TableName {
    /// Splits `text` at its first dot; `"a.b"` quoted parts keep their dots.
    pub(crate) fn parse(text: &str) -> Result<Self> {
        let parts = split_identifiers(text).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "--table '{text}' is not [SCHEMA.]NAME (quote a name holding a dot: \"a.b\")"
            ))
        })?;
        match parts.as_slice() {
            [name] => Ok(Self {
                schema: None,
                name: name.clone(),
            }),
            [schema, name] => Ok(Self {
                schema: Some(schema.clone()),
                name: name.clone(),
            }),
            _ => Err(Error::InvalidArgument(format!(
                "--table '{text}' is not [SCHEMA.]NAME"
            ))),
        }
    }

    /// `schema.name`, quoted, once the schema is known.
    pub(crate) fn qualified(&self, current_schema: &str) -> String {
        format!(
            "{}.{}",
            quote(self.schema.as_deref().unwrap_or(current_schema)),
            quote(&self.name)
        )
    }
}

/// `a.b`, `"a.b".c`: the dot-separated identifiers, unquoted.
fn split_identifiers(text: &str) -> Option<Vec<String>> {
    let mut parts = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        let mut part = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next()? {
                    '"' if chars.peek() == Some(&'"') => {
                        chars.next();
                        part.push('"');
                    }
                    '"' => break,
                    c => part.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == '.' {
                    break;
                }
                part.push(c);
                chars.next();
            }
        }
        if part.is_empty() {
            return None;
        }
        parts.push(part);
        match chars.next() {
            None => return Some(parts),
            Some('.') => {}
            Some(_) => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn urls_fill_from_the_libpq_environment_and_never_show_the_password() {
        let s = Settings::parse(
            "postgres://ann:s3cr%40t@db.example:6432/events?sslmode=verify-full",
            env(&[("PGPASSWORD", "other"), ("PGHOST", "ignored")]),
        )
        .expect("parse");
        assert_eq!(s.password.as_deref(), Some("s3cr@t"));
        assert_eq!(s.ssl_mode, SslMode::VerifyFull);
        assert_eq!(s.display(), "postgres://ann@db.example:6432/events");
        assert!(!format!("{s:?}").contains("s3cr"));

        let s = Settings::parse(
            "postgresql:///",
            env(&[
                ("PGHOST", "10.0.0.1"),
                ("PGPORT", "5433"),
                ("PGUSER", "bob"),
                ("PGPASSWORD", "pw"),
                ("PGSSLMODE", "require"),
            ]),
        )
        .expect("parse");
        assert_eq!(s.display(), "postgres://bob@10.0.0.1:5433/bob");
        assert_eq!(s.password.as_deref(), Some("pw"));
        assert_eq!(s.ssl_mode, SslMode::Require);

        let err = Settings::parse("postgres://u:hunter2@h/db?sslmode=sometimes", env(&[]))
            .expect_err("bad mode");
        assert!(err.to_string().contains("sometimes"));
        let err = Settings::parse("postgres://u:hunter2@h/db?colour=red", env(&[]))
            .expect_err("unknown parameter");
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    #[test]
    fn table_names_split_at_the_first_unquoted_dot() {
        let t = TableName::parse("events").expect("plain");
        assert_eq!(t.qualified("public"), "\"public\".\"events\"");
        let t = TableName::parse("cdc.Orders").expect("schema");
        assert_eq!(t.qualified("public"), "\"cdc\".\"Orders\"");
        let t = TableName::parse("\"a.b\".\"c\"\"d\"").expect("quoted");
        assert_eq!(t.schema.as_deref(), Some("a.b"));
        assert_eq!(t.name, "c\"d");
        for bad in ["", "a.", ".b", "a.b.c", "\"open"] {
            assert!(TableName::parse(bad).is_err(), "{bad}");
        }
    }
}
