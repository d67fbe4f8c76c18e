{{/* Name of the chart, overridable. */}}
{{- define "pagedllm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's objects: RELEASE-pagedllm, or RELEASE when it already says pagedllm. */}}
{{- define "pagedllm.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "pagedllm.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "pagedllm.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Labels of every object of the release. */}}
{{- define "pagedllm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pagedllm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector of the operator pod (immutable once installed). */}}
{{- define "pagedllm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedllm.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The operator's ServiceAccount. */}}
{{- define "pagedllm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pagedllm.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The namespaces served in namespaced mode, as a JSON list: watchNamespaces, else the release's own. */}}
{{- define "pagedllm.watchedNamespaces" -}}
{{- if .Values.clusterWide }}
{{- if .Values.watchNamespaces }}
{{- fail "clusterWide=true serves every namespace: leave watchNamespaces empty" }}
{{- end }}
{{- list | toJson }}
{{- else }}
{{- default (list .Release.Namespace) .Values.watchNamespaces | toJson }}
{{- end }}
{{- end }}
{{/* The operator's image. */}}
{{- define "pagedllm.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The default image of the servers the operator creates. */}}
{{- define "pagedllm.servingImage" -}}
{{- printf "%s:%s" .Values.servingImage.repository (default .Chart.AppVersion .Values.servingImage.tag) }}
{{- end }}

{{/*
Rules the operator needs in each namespace it serves, and nothing more (a test replays
every API call the operator makes against the emulated cluster and checks it is granted):
- pagedllms: kopf lists, watches and patches them (its annotations); the operator reads
  the owner of a changed Deployment;
- pagedllms/status: the operator writes status (merge patch);
- deployments, services: server-side applied (patch; the API server also checks create
  when an apply creates the object), watched to report status and recreate deletions;
- persistentvolumeclaims: the model cache, server-side applied;
- every child is read (get) before it is applied: one that another controller owns is
  refused, never taken over;
- horizontalpodautoscalers / scaledobjects, inferencepools, podmonitors, poddisruptionbudgets:
  the fleet objects, server-side applied, and deleted when the spec no longer asks for them
  (autoscaling or routing turned off, one replica left);
- events: what the operator did, for kubectl describe.
Nothing else is deleted by the operator: owner references cascade deletion.
*/}}
{{- define "pagedllm.namespacedRules" -}}
- apiGroups: ["pagedllm.dev"]
  resources: ["pagedllms"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["pagedllm.dev"]
  resources: ["pagedllms/status"]
  verbs: ["patch"]
# Owner references with blockOwnerDeletion need this where the
# OwnerReferencesPermissionEnforcement admission plugin runs (OpenShift).
- apiGroups: ["pagedllm.dev"]
  resources: ["pagedllms/finalizers"]
  verbs: ["update"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
# Each resource's NetworkPolicies, server-side applied, watched (a hand edit is reverted at
# once); deleted when the spec turns them off.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The fleet objects, server-side applied: the autoscaler (KEDA's ScaledObject only with
# autoscaler=keda), the InferencePool and PodMonitor where their CRDs are installed.
# The HorizontalPodAutoscaler is also watched: its conditions are the resource's AutoscalingReady.
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# With autoscaler=hpa, ScaledObjects are only read and deleted: where KEDA is installed the
# operator looks for one it made before a switch from keda, which would fight the HPA.
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: {{ if eq .Values.autoscaler "keda" }}["get", "list", "watch", "create", "patch", "delete"]{{ else }}["get", "delete"]{{ end }}
# HTTPScaledObjects (KEDA's HTTP add-on, scale from zero) only with kedaHttpAddOn; otherwise
# only looked for and deleted, like ScaledObjects, where the add-on's CRD is installed.
- apiGroups: ["http.keda.sh"]
  resources: ["httpscaledobjects"]
  verbs: {{ if and (eq .Values.autoscaler "keda") .Values.kedaHttpAddOn.enabled }}["get", "create", "patch", "delete"]{{ else }}["get", "delete"]{{ end }}
# InferencePools are also watched: a Gateway accepting one (status.parents) is RoutingReady.
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The endpoint picker Service's slices: a ready picker endpoint is part of RoutingReady.
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["list", "watch"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "create", "patch", "delete"]
# The server pods of a replica: a Deployment, or with spec.nodes > 1 a LeaderWorkerSet (where its
# CRD is installed); switching between the two deletes the other.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Server pods: read to report why a server exited (its termination message) on the resource.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create", "patch"]
# The LoRA adapter list new server pods read at start (NAME-adapters), deleted when LoRA is turned off.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch", "delete"]
# spec.apiKeySecret, read to call the server pods' adapter routes (/v1/load_lora_adapter), which ask the key.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
# The Job that fills a model cache once; watched for status.model.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# The endpoint picker of spec.routing.endpointPicker.deploy: its identity, configuration and
# Role. NOTE: Kubernetes lets the operator grant only what it holds itself, so it also
# reads pods (get) and the Inference Extension's InferenceObjectives and rewrites.
- apiGroups: [""]
  resources: ["serviceaccounts", "configmaps"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get"]
- apiGroups: ["inference.networking.x-k8s.io"]
  resources: ["inferenceobjectives", "inferencemodelrewrites"]
  verbs: ["get", "list", "watch"]
{{- end }}
