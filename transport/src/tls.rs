//! Mutual TLS for the control plane: a cluster CA, one certificate per node, and the checks that
//! make a connection *from a named node of this cluster*.
//!
//! - `pdkv certs init` ([`ClusterCa::generate`], [`write_cluster_certs`]) writes `ca.pem`,
//!   `ca.key` and `<node>.pem`/`<node>.key` for every node; each node certificate names its node
//!   as a DNS subject alternative name. An embedded default may use an in-memory CA instead.
//! - Servers require a client certificate chaining to the CA; clients check the server's
//!   certificate chains to the CA and names the node they dialled.
//! - After the handshake, [`verify_peer_name`] checks that the certificate a peer presented is
//!   valid for the node name it claims, and the caller checks that name belongs to the cluster.

use std::path::Path;
use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::codec::ALPN;

/// A cluster certificate authority (certificate and signing key, PEM).
pub struct ClusterCa {
    cert_pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

/// A node's certificate and key, PEM.
#[derive(Clone)]
pub struct NodeCertPem {
    /// The node's certificate, signed by the CA.
    pub cert_pem: String,
    /// The node's private key.
    pub key_pem: String,
}

impl ClusterCa {
    /// A fresh CA for `cluster`.
    pub fn generate(cluster: &str) -> Result<Self, TlsError> {
        let key = KeyPair::generate().map_err(rcgen_error)?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(rcgen_error)?;
        params
            .distinguished_name
            .push(DnType::CommonName, format!("pdkv cluster CA {cluster}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).map_err(rcgen_error)?;
        let key_pem = key.serialize_pem();
        Ok(ClusterCa {
            cert_pem: cert.pem(),
            key_pem,
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA certificate (PEM), what every node trusts.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA's signing key (PEM); keep it off the nodes.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// Issues a certificate naming `node` (a DNS name such as `prefill-0`).
    pub fn issue(&self, node: &str) -> Result<NodeCertPem, TlsError> {
        ServerName::try_from(node.to_string()).map_err(|_| TlsError::BadNodeName(node.to_string()))?;
        let key = KeyPair::generate().map_err(rcgen_error)?;
        let mut params = CertificateParams::new(vec![node.to_string()]).map_err(rcgen_error)?;
        params
            .distinguished_name
            .push(DnType::CommonName, node.to_string());
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &self.issuer).map_err(rcgen_error)?;
        Ok(NodeCertPem {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// An in-memory identity for `node` (embedded defaults and tests).
    pub fn identity(&self, node: &str) -> Result<NodeIdentity, TlsError> {
        let pem = self.issue(node)?;
        NodeIdentity::from_pem(node, &pem.cert_pem, &pem.key_pem, &self.cert_pem)
    }
}

/// File names `pdkv certs init` writes for the CA; no node may take this name.
pub const CA_FILE_STEM: &str = "ca";

/// Whether [`write_cluster_certs`] may replace files that are already there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    /// Refuse if any output file (or a symlink in its place) exists.
    Refuse,
    /// Replace every output file atomically (a new file renamed over the old, never written
    /// through a symlink or into an existing inode).
    Replace,
}

/// Writes a CA and one certificate per node into `dir` (`ca.pem`, `ca.key`, `<node>.pem`,
/// `<node>.key`).
///
/// Every file is created fresh with `O_CREAT | O_EXCL | O_NOFOLLOW`, keys with mode 0600 from the
/// first byte (certificates 0644), so no key is ever world-readable, written through a symlink or
/// into a file someone else opened. With [`Existing::Refuse`] any existing output is an error
/// naming it; with [`Existing::Replace`] each file is written beside its target and renamed over
/// it. Node names must be distinct, valid DNS names, and not [`CA_FILE_STEM`].
pub fn write_cluster_certs(
    dir: &Path,
    cluster: &str,
    nodes: &[&str],
    existing: Existing,
) -> Result<(), TlsError> {
    let mut seen = std::collections::HashSet::new();
    for &node in nodes {
        if node == CA_FILE_STEM {
            return Err(TlsError::ReservedNodeName(node.to_string()));
        }
        ServerName::try_from(node.to_string()).map_err(|_| TlsError::BadNodeName(node.to_string()))?;
        if node.contains('/') || !seen.insert(node) {
            return Err(TlsError::BadNodeName(node.to_string()));
        }
    }
    let io = |path: &Path, error: std::io::Error| TlsError::Io(format!("{}: {error}", path.display()));
    std::fs::create_dir_all(dir).map_err(|error| io(dir, error))?;
    let outputs: Vec<(std::path::PathBuf, bool)> = std::iter::once(CA_FILE_STEM)
        .chain(nodes.iter().copied())
        .flat_map(|stem| {
            [
                (dir.join(format!("{stem}.pem")), false),
                (dir.join(format!("{stem}.key")), true),
            ]
        })
        .collect();
    if existing == Existing::Refuse
        && let Some((path, _)) = outputs.iter().find(|(path, _)| path.symlink_metadata().is_ok())
    {
        return Err(TlsError::Exists(path.display().to_string()));
    }
    let ca = ClusterCa::generate(cluster)?;
    let mut contents = vec![ca.cert_pem().to_string(), ca.key_pem().to_string()];
    for node in nodes {
        let pem = ca.issue(node)?;
        contents.push(pem.cert_pem);
        contents.push(pem.key_pem);
    }
    for ((path, secret), text) in outputs.iter().zip(&contents) {
        let mode = if *secret { 0o600 } else { 0o644 };
        match existing {
            Existing::Refuse => write_new_file(path, text, mode).map_err(|error| io(path, error))?,
            Existing::Replace => {
                let name = path
                    .file_name()
                    .map(|name| name.to_string_lossy())
                    .unwrap_or_default();
                let mut suffix = [0u8; 8];
                getrandom::fill(&mut suffix).map_err(|error| TlsError::Io(error.to_string()))?;
                let temporary = dir.join(format!(".{name}.{}.tmp", u64::from_le_bytes(suffix)));
                write_new_file(&temporary, text, mode).map_err(|error| io(&temporary, error))?;
                if let Err(error) = std::fs::rename(&temporary, path) {
                    let _ = std::fs::remove_file(&temporary);
                    return Err(io(path, error));
                }
            }
        }
    }
    Ok(())
}

/// Creates `path`, which must not exist (a symlink counts as existing), with `mode`, and writes
/// `contents` to it.
fn write_new_file(path: &Path, contents: &str, mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(mode)
        .open(path)?;
    file.write_all(contents.as_bytes())?;
    file.sync_all()
}

/// What a node presents and trusts.
#[derive(Debug)]
pub struct NodeIdentity {
    name: String,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: Arc<RootCertStore>,
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        NodeIdentity {
            name: self.name.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
            roots: self.roots.clone(),
        }
    }
}

impl NodeIdentity {
    /// Builds an identity from PEM text.
    pub fn from_pem(name: &str, cert_pem: &str, key_pem: &str, ca_pem: &str) -> Result<Self, TlsError> {
        let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| TlsError::Pem(format!("{name} certificate: {error}")))?;
        if chain.is_empty() {
            return Err(TlsError::Pem(format!(
                "{name} certificate: no certificate in PEM"
            )));
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|error| TlsError::Pem(format!("{name} key: {error}")))?;
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            let ca = ca.map_err(|error| TlsError::Pem(format!("CA certificate: {error}")))?;
            roots
                .add(ca)
                .map_err(|error| TlsError::Pem(format!("CA certificate: {error}")))?;
        }
        if roots.is_empty() {
            return Err(TlsError::Pem("CA certificate: no certificate in PEM".into()));
        }
        Ok(NodeIdentity {
            name: name.to_string(),
            chain,
            key,
            roots: Arc::new(roots),
        })
    }

    /// Loads `<dir>/<name>.pem`, `<dir>/<name>.key` and `<dir>/ca.pem`.
    pub fn load(dir: &Path, name: &str) -> Result<Self, TlsError> {
        let read = |file: String| {
            let path = dir.join(&file);
            std::fs::read_to_string(&path)
                .map_err(|error| TlsError::Io(format!("{}: {error}", path.display())))
        };
        Self::from_pem(
            name,
            &read(format!("{name}.pem"))?,
            &read(format!("{name}.key"))?,
            &read("ca.pem".into())?,
        )
    }

    /// The node name the identity was issued for.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A QUIC server config that requires clients to present a certificate from the CA.
    pub fn server_config(&self) -> Result<quinn::ServerConfig, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider.clone())
            .build()
            .map_err(|error| TlsError::Config(error.to_string()))?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|error| TlsError::Config(error.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|error| TlsError::Config(error.to_string()))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        let crypto =
            QuicServerConfig::try_from(config).map_err(|error| TlsError::Config(error.to_string()))?;
        Ok(quinn::ServerConfig::with_crypto(Arc::new(crypto)))
    }

    /// A QUIC client config that presents this identity and trusts only the CA.
    pub fn client_config(&self) -> Result<quinn::ClientConfig, TlsError> {
        self.client(true)
    }

    /// A client config that presents no certificate (to prove servers refuse it).
    pub fn anonymous_client_config(&self) -> Result<quinn::ClientConfig, TlsError> {
        self.client(false)
    }

    fn client(&self, present_identity: bool) -> Result<quinn::ClientConfig, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|error| TlsError::Config(error.to_string()))?
            .with_root_certificates(self.roots.clone());
        let mut config = if present_identity {
            builder
                .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
                .map_err(|error| TlsError::Config(error.to_string()))?
        } else {
            builder.with_no_client_auth()
        };
        config.alpn_protocols = vec![ALPN.to_vec()];
        let crypto =
            QuicClientConfig::try_from(config).map_err(|error| TlsError::Config(error.to_string()))?;
        Ok(quinn::ClientConfig::new(Arc::new(crypto)))
    }
}

/// Checks that the certificate `connection`'s peer presented is valid for node `claimed`.
/// The chain was already verified against the CA during the TLS handshake.
pub fn verify_peer_name(connection: &quinn::Connection, claimed: &str) -> Result<(), TlsError> {
    let identity = connection.peer_identity().ok_or(TlsError::NoPeerCertificate)?;
    let chain = identity
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| TlsError::NoPeerCertificate)?;
    let leaf = chain.first().ok_or(TlsError::NoPeerCertificate)?;
    let cert = webpki::EndEntityCert::try_from(leaf).map_err(|error| TlsError::Config(error.to_string()))?;
    let name =
        ServerName::try_from(claimed.to_string()).map_err(|_| TlsError::BadNodeName(claimed.to_string()))?;
    cert.verify_is_valid_for_subject_name(&name)
        .map_err(|_| TlsError::NameMismatch(claimed.to_string()))
}

fn rcgen_error(error: rcgen::Error) -> TlsError {
    TlsError::Config(error.to_string())
}

/// Why a certificate, key or TLS configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsError {
    /// Node names must be DNS names (they appear in certificates).
    #[error("node name {0:?} is not a valid DNS name")]
    BadNodeName(String),
    /// The peer presented no certificate.
    #[error("peer presented no certificate")]
    NoPeerCertificate,
    /// The peer's certificate does not name the node it claims to be.
    #[error("peer certificate is not valid for node {0:?}")]
    NameMismatch(String),
    /// PEM text could not be parsed.
    #[error("bad PEM: {0}")]
    Pem(String),
    /// A file could not be read or written.
    #[error("{0}")]
    Io(String),
    /// An output file is already there and replacing was not asked for.
    #[error("{0} exists (pass --force to replace the CA and every node certificate)")]
    Exists(String),
    /// A node may not take a name the CA's files use.
    #[error("node name {0:?} is reserved for the cluster CA's files (ca.pem, ca.key)")]
    ReservedNodeName(String),
    /// rustls, quinn or rcgen refused the configuration.
    #[error("TLS configuration: {0}")]
    Config(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names that would collide with the CA's files, or with each other, or leave the directory
    /// are refused before anything is written.
    #[test]
    fn colliding_or_unsafe_node_names_are_refused_before_writing() {
        let dir = std::env::temp_dir().join(format!("pdkv-tls-names-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cases: [(&[&str], TlsError); 4] = [
            (&["ca"], TlsError::ReservedNodeName("ca".into())),
            (&["a", "a"], TlsError::BadNodeName("a".into())),
            (&["../x"], TlsError::BadNodeName("../x".into())),
            (&[""], TlsError::BadNodeName(String::new())),
        ];
        for (nodes, expected) in cases {
            assert_eq!(
                write_cluster_certs(&dir, "t", nodes, Existing::Refuse).unwrap_err(),
                expected
            );
            assert!(!dir.exists(), "nothing written for {nodes:?}");
        }
    }
}
