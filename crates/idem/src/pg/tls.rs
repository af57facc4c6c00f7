//! TLS for PostgreSQL connections by rustls, with libpq's meaning of each `sslmode`:
//! `prefer` and `require` encrypt without checking the certificate (unless a root
//! certificate is given, when `require` checks it as `verify-ca` does), `verify-ca` checks
//! the chain, `verify-full` the chain and the host name.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    ClientConfig, DigitallySignedStruct, Error as TlsError, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

/// A connector that checks the server's certificate as `checks` say, trusting `root_cert`
/// (a PEM file, or `system`) or else `~/.postgresql/root.crt` or the system's roots.
pub(super) fn connector(
    checks: Checks,
    root_cert: Option<&str>,
) -> Result<MakeRustlsConnect, String> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let config = match checks {
        Checks::None => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
            .with_no_client_auth(),
        Checks::Chain | Checks::Full => {
            let roots = Arc::new(roots(root_cert)?);
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| format!("TLS: {e}"))?;
            if checks == Checks::Full {
                builder.with_webpki_verifier(webpki).with_no_client_auth()
            } else {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
                    .with_no_client_auth()
            }
        }
    };
    Ok(MakeRustlsConnect::new(config))
}

/// What is checked of the server's certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Checks {
    /// Nothing: encrypted, but anyone may be at the other end.
    None,
    /// The chain up to a trusted root.
    Chain,
    /// The chain and the host name.
    Full,
}

fn roots(root_cert: Option<&str>) -> Result<RootCertStore, String> {
    let mut store = RootCertStore::empty();
    let file = match root_cert {
        Some("system") => None,
        Some(path) => Some(std::path::PathBuf::from(path)),
        None => std::env::var_os("HOME")
            .map(|home| std::path::Path::new(&home).join(".postgresql/root.crt"))
            .filter(|p| p.exists()),
    };
    match file {
        Some(path) => {
            for cert in CertificateDer::pem_file_iter(&path)
                .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?
            {
                let cert = cert.map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
                store
                    .add(cert)
                    .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                // Unparsable system certificates are skipped, as every TLS client does.
                drop(store.add(cert));
            }
        }
    }
    if store.is_empty() {
        return Err(
            "TLS: no root certificates to verify the server with (set sslrootcert)".to_owned(),
        );
    }
    Ok(store)
}

/// Encrypts without checking who is at the other end (libpq's `prefer` and `require`);
/// handshake signatures are still checked.
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, TlsError> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Checks the chain but not the name (libpq's `verify-ca`).
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, TlsError> {
        use rustls::CertificateError::{NotValidForName, NotValidForNameContext};
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(TlsError::InvalidCertificate(NotValidForName | NotValidForNameContext { .. })) => {
                Ok(ServerCertVerified::assertion())
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
