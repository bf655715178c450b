{{/* Chart name, overridable. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: <release>-<chart>, or just the release when it already contains the chart name. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object of the release. The operator's own objects are component=operator,
so selectors never match the worker and router pods it creates (component=prefill|decode|router). */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* "true" when the operator watches only the listed namespaces. */}}
{{- define "tandem.namespaced" -}}
{{- if .Values.operator.watchNamespaces }}true{{ end }}
{{- end }}

{{/*
What the operator does to the API, one rule per resource so each can be checked on its own
(docs/helm.md says why each is needed). Children are written only by server-side apply (patch,
plus create when the object is new) and removed by garbage collection through their owner
references, so there is no update or delete. The router's endpoint-watching Role is created by
the operator, and Kubernetes only lets it grant rights it holds itself: hence the read rules on
pods, endpoints and endpointslices.
*/}}
{{- define "tandem.operatorRules" -}}
- apiGroups: [tandem.dev]
  resources: [disaggregatedmodels]
  verbs: [get, list, watch, patch]
- apiGroups: [tandem.dev]
  resources: [disaggregatedmodels/status]
  verbs: [patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, patch]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [create, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles]
  verbs: [create, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [rolebindings]
  verbs: [create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [endpoints]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- with .Values.rbac.extraRules }}
{{ toYaml . }}
{{- end }}
{{- end }}
