{{/* The chart's short name. */}}
{{- define "modelload.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name: the prefix of every object this chart creates (40 characters leave room for suffixes). */}}
{{- define "modelload.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "modelload.selectorLabels" -}}
app.kubernetes.io/name: {{ include "modelload.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "modelload.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "modelload.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "modelload.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "modelload.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "modelload.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "modelload.sidecarImage" -}}
{{- printf "%s:%s" .Values.sidecar.image.repository (default .Chart.AppVersion .Values.sidecar.image.tag) -}}
{{- end -}}

{{- define "modelload.webhookService" -}}
{{- printf "%s-webhook" (include "modelload.fullname" .) -}}
{{- end -}}

{{- define "modelload.tlsSecret" -}}
{{- printf "%s-webhook-tls" (include "modelload.fullname" .) -}}
{{- end -}}

{{- define "modelload.certificate" -}}
{{- printf "%s-webhook" (include "modelload.fullname" .) -}}
{{- end -}}

{{/* The rules the handlers and the webhook need, in whatever scope they are granted. */}}
{{- define "modelload.workloadRules" -}}
# ModelLoads: kopf watches them and patches its progress annotations; the webhook lists them.
- apiGroups: ["modelload.dev"]
  resources: ["modelloads"]
  verbs: ["get", "list", "watch", "patch"]
# The status: the resolver and the pod aggregation write it.
- apiGroups: ["modelload.dev"]
  resources: ["modelloads/status"]
  verbs: ["get", "patch"]
# Pods: watched (never written) to count their loads.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# Secrets: the S3 credentials and key Secrets that ModelLoads reference, read to check them and fetch the index,
# and each peered model's token Secret, read to ask its pods for their peer stats (status.fleet).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
# Peers (spec.peers): a headless Service and a token Secret per ModelLoad, created once, owned by it. The
# Service is read and its selector patched when the ModelLoad's spec.podLabelValue changes.
- apiGroups: [""]
  resources: ["services", "secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "patch"]
# Events about ModelLoads (kopf posts core/v1 Events).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}
