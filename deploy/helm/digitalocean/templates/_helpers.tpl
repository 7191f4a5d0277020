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
