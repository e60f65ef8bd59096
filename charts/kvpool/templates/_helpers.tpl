{{/* Chart name, or nameOverride. */}}
{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: <release>-<name>, or <release> when it already contains the name. */}}
{{- define "kvpool.fullname" -}}
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

{{/* Name of cluster-scoped objects: unique per release namespace too. */}}
{{- define "kvpool.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "kvpool.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: minimal and immutable. The component keeps them apart from the
     pools' own sidecar pods, which carry app.kubernetes.io/name=kvpool too. */}}
{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Standard labels of every object of the chart. */}}
{{- define "kvpool.labels" -}}
helm.sh/chart: {{ include "kvpool.chart" . }}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvpool
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvpool.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag[@digest] of an image block. */}}
{{- define "kvpool.image" -}}
{{- $tag := required "image tags must be set (pinned)" .tag | toString }}
{{- if eq $tag "latest" }}{{ fail "image tag \"latest\" is not allowed: pin a version" }}{{ end }}
{{- if .digest }}
{{- printf "%s:%s@%s" .repository $tag .digest }}
{{- else }}
{{- printf "%s:%s" .repository $tag }}
{{- end }}
{{- end }}

{{/* The namespaces the operator serves, as a list (empty: cluster-wide). */}}
{{- define "kvpool.watchNamespaces" -}}
{{- if .Values.watch.clusterWide }}
{{- if .Values.watch.namespaces }}{{ fail "watch.namespaces must be empty when watch.clusterWide is true" }}{{ end }}
{{- toJson list }}
{{- else if .Values.watch.namespaces }}
{{- toJson (uniq .Values.watch.namespaces) }}
{{- else }}
{{- toJson (list .Release.Namespace) }}
{{- end }}
{{- end }}

{{/* The rules the operator needs in every namespace it serves (see the chart's README). */}}
{{- define "kvpool.namespacedRules" -}}
# The pools: kopf lists and watches them, patches its finalizer and progress annotations
# on them, and writes their status.
- apiGroups: ["kvpool.io"]
  resources: ["kvcachepools"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["kvpool.io"]
  resources: ["kvcachepools/status"]
  verbs: ["patch"]
# Owner references with blockOwnerDeletion on the children (OwnerReferencesPermissionEnforcement).
- apiGroups: ["kvpool.io"]
  resources: ["kvcachepools/finalizers"]
  verbs: ["update"]
# The pools' children: read (ownership check), server-side apply (patch; create when new),
# delete when no longer wanted (e.g. managed Redis switched off). No list, no watch. RBAC
# cannot narrow these to the pools' children (their names are not known in advance): they
# hold for every object of these kinds in the namespace (in every namespace, cluster-wide),
# every Secret included.
- apiGroups: [""]
  resources: ["configmaps", "secrets", "services"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["daemonsets", "statefulsets"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
# kopf reports handler warnings and errors as events on the pools.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
