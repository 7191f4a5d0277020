//! What `cargo xtask helm` checks: the charts with the flags their binaries accept, and the
//! values each chart must refuse.

pub(super) struct Chart {
    /// Directory under deploy/helm and name of the provider binary.
    pub(super) name: &'static str,
    /// Every flag the provider binary accepts, without the leading dashes.
    pub(super) flags: &'static [&'static str],
    /// Flags whose value is a file or socket path inside the pod.
    pub(super) path_flags: &'static [&'static str],
    /// Environment variables that carry secrets and must come from a Secret.
    pub(super) secret_env: &'static [&'static str],
}

pub(super) const COMMON_FLAGS: &[&str] = &[
    "addr",
    "metrics-addr",
    "provider",
    "use-fake-backend",
    "offerings",
    "seed-count",
    "state",
    "image",
    "base-user-data",
    "price-refresh",
    "reconcile-interval",
    "reflection",
    "tls-cert",
    "tls-key",
    "tls-ca",
    "create-timeout",
    "configure-timeout",
    "drain-timeout",
    "delete-timeout",
    "shutdown-grace",
    "log-format",
    "log-level",
    "fake-latency",
    "admin-socket",
    "etcd-ca",
    "etcd-cert",
    "etcd-key",
    "etcd-lease-ttl",
    "leader-label",
];

/// Flags that would put a secret on the command line, visible in the pod spec.
pub(super) const SECRET_FLAGS: &[&str] = &["token", "bootstrap-secret"];

pub(super) const CHARTS: [Chart; 2] = [
    Chart {
        name: "hetzner",
        flags: &[
            "hetzner-backend",
            "location-a",
            "location-b",
            "eur-usd",
            "ssh-key",
            "ssh-user",
            "ssh-port",
            "ssh-address",
            "network",
            "image-selector",
            "firewall",
            "public-ipv4",
            "public-ipv6",
            "placement",
            "server-label",
            "login-ssh-key",
            "bootstrap-hook",
            "hcloud-endpoint",
            "readiness-command",
        ],
        path_flags: &[
            "ssh-key",
            "offerings",
            "base-user-data",
            "state",
            "tls-cert",
            "tls-key",
            "tls-ca",
            "admin-socket",
            "etcd-ca",
            "etcd-cert",
            "etcd-key",
        ],
        secret_env: &["HCLOUD_TOKEN"],
    },
    Chart {
        name: "digitalocean",
        flags: &[
            "do-backend",
            "region",
            "region-a",
            "region-b",
            "do-api-url",
            "bootstrap-addr",
            "bootstrap-endpoint",
            "bootstrap-tls-cert",
            "bootstrap-tls-key",
            "bootstrap-ca",
            "vpc-uuid",
            "tag",
            "ipv6",
            "monitoring",
            "login-ssh-key",
        ],
        path_flags: &[
            "offerings",
            "base-user-data",
            "state",
            "tls-cert",
            "tls-key",
            "tls-ca",
            "admin-socket",
            "bootstrap-tls-cert",
            "bootstrap-tls-key",
            "bootstrap-ca",
            "etcd-ca",
            "etcd-cert",
            "etcd-key",
        ],
        secret_env: &["DIGITALOCEAN_TOKEN", "BIGFLEET_BOOTSTRAP_SECRET"],
    },
];

/// Values that must make the render (or the validation) fail, with part of the message.
pub(super) struct Refusal {
    pub(super) chart: &'static str,
    pub(super) what: &'static str,
    pub(super) values: &'static str,
    pub(super) message: &'static str,
}

pub(super) const REFUSALS: &[Refusal] = &[
    Refusal {
        chart: "digitalocean",
        what: "a VPC UUID that is not one",
        values: "digitalocean:\n  vpcUUID: prod-vpc\n",
        message: "vpcUUID",
    },
    Refusal {
        chart: "digitalocean",
        what: "a tag DigitalOcean refuses",
        values: "digitalocean:\n  tags: [\"k8s node\"]\n",
        message: "tags",
    },
    Refusal {
        chart: "digitalocean",
        what: "a tag reserved for the provider's own",
        values: "digitalocean:\n  tags: [bigfleet-managed]\n",
        message: "is reserved for the provider's own tags",
    },
    Refusal {
        chart: "digitalocean",
        what: "bootstrap channel without an endpoint",
        values: "bootstrap:\n  enabled: true\n  tlsSecretName: t\n  secretName: s\n",
        message: "bootstrap.endpoint is required",
    },
    Refusal {
        chart: "digitalocean",
        what: "bootstrap channel without its HMAC Secret",
        values: "bootstrap:\n  enabled: true\n  endpoint: https://x:9443\n  tlsSecretName: t\n",
        message: "bootstrap.secretName is required",
    },
    Refusal {
        chart: "hetzner",
        what: "TLS without a Secret",
        values: "tls:\n  enabled: true\n",
        message: "tls.secretName is required",
    },
    Refusal {
        chart: "hetzner",
        what: "mTLS without TLS",
        values: "tls:\n  mtls: true\n",
        message: "tls.mtls=true needs tls.enabled=true",
    },
    Refusal {
        chart: "hetzner",
        what: "an unknown log format",
        values: "logFormat: yaml\n",
        message: "logFormat",
    },
    Refusal {
        chart: "digitalocean",
        what: "a duration that is not Go syntax",
        values: "timeouts:\n  drain: 15 minutes\n",
        message: "drain",
    },
    Refusal {
        chart: "hetzner",
        what: "SSH over a public IPv4 the servers do not get",
        values: "hetzner:\n  publicIPv4: false\n",
        message: "ssh.address=public needs hetzner.publicIPv4=true",
    },
    Refusal {
        chart: "hetzner",
        what: "an unknown placement",
        values: "hetzner:\n  placement: pack\n",
        message: "placement",
    },
    Refusal {
        chart: "hetzner",
        what: "a reserved server label",
        values: "hetzner:\n  serverLabels:\n    bigfleet-managed: \"false\"\n",
        message: "bigfleet-managed",
    },
    Refusal {
        chart: "hetzner",
        what: "an image and an image selector",
        values: "hetzner:\n  image: ubuntu-24.04\n  imageSelector: role=node\n",
        message: "not both",
    },
    Refusal {
        chart: "hetzner",
        what: "a network subnet that is not a range",
        values: "hetzner:\n  networks: [\"k8s=10.0.1.0\"]\n",
        message: "networks",
    },
    Refusal {
        chart: "hetzner",
        what: "a misspelt top-level key",
        values: "locaton: hel1\n",
        message: "locaton",
    },
    Refusal {
        chart: "digitalocean",
        what: "an alert `for` that is not a Prometheus duration",
        values: "prometheusRule:\n  enabled: true\n  alerts:\n    down: {enabled: true, for: 5 minutes, severity: critical}\n",
        message: "5 minutes",
    },
    Refusal {
        chart: "hetzner",
        what: "an alert ratio above 1",
        values: "prometheusRule:\n  alerts:\n    cloudAPIRateLimited: {enabled: true, window: 10m, ratio: 10, for: 15m, severity: warning}\n",
        message: "ratio",
    },
    Refusal {
        chart: "hetzner",
        what: "replicas of a local state",
        values: "replicaCount: 2\n",
        message: "replicaCount > 1 needs the state in etcd",
    },
    Refusal {
        chart: "digitalocean",
        what: "replicas of a local state",
        values: "replicaCount: 3\nstate:\n  enabled: true\n",
        message: "replicaCount > 1 needs the state in etcd",
    },
    Refusal {
        chart: "hetzner",
        what: "etcd endpoints without a prefix",
        values: "replicaCount: 2\nha:\n  etcd:\n    endpoints: [etcd-0:2379]\n",
        message: "ha.etcd.prefix is required",
    },
    Refusal {
        chart: "digitalocean",
        what: "a local state and etcd at once",
        values: "replicaCount: 2\nstate:\n  enabled: true\nha:\n  etcd:\n    endpoints: [etcd-0:2379]\n    prefix: /bigfleet/do\n",
        message: "exclude each other",
    },
    Refusal {
        chart: "hetzner",
        what: "an object Kubernetes would reject",
        values: "extraEnv:\n  - name: HTTPS_PROXY\n    valu: http://proxy:3128\n",
        message: "valu",
    },
];
