{{/*
Names. The selector labels and the fullname rule match the reference Go provider's chart, so
an existing release upgrades in place (a Deployment's selector cannot change) and keeps its
state PVC.
*/}}
{{- define "bigfleet-digitalocean.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "bigfleet-digitalocean.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "bigfleet-digitalocean.name" . -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "bigfleet-digitalocean.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "bigfleet-digitalocean.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bigfleet-digitalocean.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "bigfleet-digitalocean.labels" -}}
helm.sh/chart: {{ include "bigfleet-digitalocean.chart" . }}
{{ include "bigfleet-digitalocean.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: capacity-provider
app.kubernetes.io/part-of: bigfleet
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "bigfleet-digitalocean.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "bigfleet-digitalocean.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository:tag, or repository@digest when a digest pins the image. */}}
{{- define "bigfleet-digitalocean.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The claim the state volume uses: an operator's existing one, or the chart's own. */}}
{{- define "bigfleet-digitalocean.stateClaim" -}}
{{- default (printf "%s-state" (include "bigfleet-digitalocean.fullname" .)) .Values.state.persistence.existingClaim -}}
{{- end -}}

{{/* The labels of one alert: its severity and the operator's extra alert labels. */}}
{{- define "bigfleet-digitalocean.alertLabels" -}}
severity: {{ .alert.severity }}
{{- with .rule.alertLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* HA mode: the state in etcd, shared by the replicas ("true", or empty). */}}
{{- define "bigfleet-digitalocean.ha" -}}
{{- if .Values.ha.etcd.endpoints -}}true{{- end -}}
{{- end -}}

{{/* HA mode with the Service routed to the leader by its pod label ("true", or empty). */}}
{{- define "bigfleet-digitalocean.leaderLabel" -}}
{{- if and (include "bigfleet-digitalocean.ha" .) .Values.ha.leaderLabel -}}true{{- end -}}
{{- end -}}

{{/* The ValidatingAdmissionPolicy narrowing the leader label's patch right ("true", or empty):
with the leader label on, and ha.leaderLabelPolicy true, or auto on Kubernetes 1.30 and later. */}}
{{- define "bigfleet-digitalocean.leaderLabelPolicy" -}}
{{- if include "bigfleet-digitalocean.leaderLabel" . -}}
{{- $mode := toString .Values.ha.leaderLabelPolicy -}}
{{- if or (eq $mode "true") (and (eq $mode "auto") (semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version)) -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* What HA mode refuses. */}}
{{- define "bigfleet-digitalocean.haChecks" -}}
{{- $ha := include "bigfleet-digitalocean.ha" . -}}
{{- if and (gt (int .Values.replicaCount) 1) (not $ha) -}}
{{- fail "replicaCount > 1 needs the state in etcd (ha.etcd.endpoints and ha.etcd.prefix): replicas of a local state would each keep their own fence marks and operation ids" -}}
{{- end -}}
{{- if $ha -}}
{{- if not .Values.ha.etcd.prefix -}}
{{- fail "ha.etcd.prefix is required with ha.etcd.endpoints: the key prefix of this release's state, unique per provider instance (e.g. /bigfleet/digitalocean-ams3)" -}}
{{- end -}}
{{- if .Values.state.enabled -}}
{{- fail "state.enabled (a local state on a volume) and ha.etcd.endpoints (the state in etcd) exclude each other" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* --state for HA mode: etcd://MEMBER,MEMBER/PREFIX. */}}
{{- define "bigfleet-digitalocean.etcdState" -}}
{{- $prefix := .Values.ha.etcd.prefix -}}
{{- if not (hasPrefix "/" $prefix) -}}{{- $prefix = printf "/%s" $prefix -}}{{- end -}}
{{- printf "etcd://%s%s" (join "," .Values.ha.etcd.endpoints) $prefix -}}
{{- end -}}

{{/* The etcd members' client ports, for the NetworkPolicy (2379 when an endpoint has none). */}}
{{- define "bigfleet-digitalocean.etcdPorts" -}}
{{- $ports := list -}}
{{- range .Values.ha.etcd.endpoints -}}
{{- $port := "2379" -}}
{{- if regexMatch ":[0-9]+$" . -}}{{- $port = regexFind "[0-9]+$" . -}}{{- end -}}
{{- $ports = append $ports $port -}}
{{- end -}}
{{- $ports | uniq | sortAlpha | join "," -}}
{{- end -}}

{{/* A state that outlives the process, local (state.enabled) or in etcd ("true", or empty). */}}
{{- define "bigfleet-digitalocean.durableState" -}}
{{- if or .Values.state.enabled (include "bigfleet-digitalocean.ha" .) -}}true{{- end -}}
{{- end -}}

{{/* Sealed Configure blobs: the key Secret is mounted and passed ("true", or empty). Without a
durable state there is nothing to seal and the binary refuses the flag, so it is left out. */}}
{{- define "bigfleet-digitalocean.stateEncryption" -}}
{{- if and .Values.stateEncryption.enabled (include "bigfleet-digitalocean.durableState" .) -}}true{{- end -}}
{{- end -}}

{{/* The Secret with the state encryption keys: the operator's, or the one the chart keeps. */}}
{{- define "bigfleet-digitalocean.stateKeySecret" -}}
{{- default (printf "%s-state-key" (include "bigfleet-digitalocean.fullname" .)) .Values.stateEncryption.existingSecret -}}
{{- end -}}

{{/* What state encryption refuses. */}}
{{- define "bigfleet-digitalocean.stateEncryptionChecks" -}}
{{- $enc := .Values.stateEncryption -}}
{{- if and (include "bigfleet-digitalocean.ha" .) (not $enc.enabled) -}}
{{- fail "ha.etcd.endpoints needs stateEncryption.enabled=true: without --state-encryption-key-file every leader change and rolling update fails the Configures in flight (their bootstrap blobs are not kept in etcd)" -}}
{{- end -}}
{{- if not (include "bigfleet-digitalocean.durableState" .) -}}
{{- if $enc.existingSecret -}}
{{- fail "stateEncryption.existingSecret is set but the state is in memory: set state.enabled=true (or ha.etcd.endpoints), there is nothing to seal without a state" -}}
{{- end -}}
{{- if $enc.failUnreadableConfigures -}}
{{- fail "stateEncryption.failUnreadableConfigures=true needs a state (state.enabled=true or ha.etcd.endpoints): an in-memory state holds no sealed Configure" -}}
{{- end -}}
{{- end -}}
{{- end -}}
