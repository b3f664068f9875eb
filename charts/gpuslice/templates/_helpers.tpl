{{/*
Names, labels and shared pod pieces. Component names: partitioner, agent.
*/}}

{{- define "gpuslice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpuslice.fullname" -}}
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

{{/* "<fullname>-<suffix>", kept within 63 characters. Call with (list $ "suffix"). */}}
{{- define "gpuslice.componentName" -}}
{{- $root := index . 0 }}
{{- $suffix := index . 1 }}
{{- printf "%s-%s" (include "gpuslice.fullname" $root | trunc (int (sub 62 (len $suffix)))) $suffix | trimSuffix "-" }}
{{- end }}

{{- define "gpuslice.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "gpuslice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpuslice
{{- end }}

{{/* Selector labels of one component. Call with (list $ "partitioner"). */}}
{{- define "gpuslice.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "gpuslice.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* The image reference; global.imageRegistry, when set, replaces image.registry. */}}
{{- define "gpuslice.image" -}}
{{- $img := .Values.image }}
{{- $registry := default $img.registry ((.Values.global).imageRegistry) }}
{{- $repo := $img.repository }}
{{- if $registry }}{{ $repo = printf "%s/%s" $registry $img.repository }}{{ end }}
{{- if $img.digest }}
{{- printf "%s@%s" $repo $img.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default .Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{/* ServiceAccount names: <component>.serviceAccount.name, else <fullname>-<component>
(whether or not the chart creates them: serviceAccount.create). */}}
{{- define "gpuslice.partitionerServiceAccount" -}}
{{ default (include "gpuslice.componentName" (list . "partitioner")) .Values.partitioner.serviceAccount.name }}
{{- end }}

{{- define "gpuslice.agentServiceAccount" -}}
{{ default (include "gpuslice.componentName" (list . "agent")) .Values.agent.serviceAccount.name }}
{{- end }}

{{/* The uninstall hook's ServiceAccount: webhook.ungateServiceAccount.name, else
<fullname>-ungate (created for the hook only when serviceAccount.create). */}}
{{- define "gpuslice.ungateServiceAccount" -}}
{{ default (include "gpuslice.componentName" (list . "ungate")) .Values.webhook.ungateServiceAccount.name }}
{{- end }}

{{- define "gpuslice.catalogConfigMap" -}}
{{ include "gpuslice.componentName" (list . "catalog") }}
{{- end }}

{{/* Mount point of the catalog override ConfigMap in both components. */}}
{{- define "gpuslice.catalogDir" -}}/etc/gpuslice/catalog{{- end }}

{{/* Comma-separated catalog override paths in file-name order (GPUSLICE_CATALOG_FILES). */}}
{{- define "gpuslice.catalogFiles" -}}
{{- $dir := include "gpuslice.catalogDir" . }}
{{- $paths := list }}
{{- range $name := keys .Values.catalog.files | sortAlpha }}
{{- $paths = append $paths (printf "%s/%s" $dir $name) }}
{{- end }}
{{- join "," $paths }}
{{- end }}

{{/* Pod annotation that rolls both components when the catalog overrides change. */}}
{{- define "gpuslice.catalogChecksum" -}}
checksum/catalog: {{ toJson .Values.catalog.files | sha256sum }}
{{- end }}

{{/* Env shared by both components. */}}
{{- define "gpuslice.commonEnv" -}}
- name: GPUSLICE_LOG_LEVEL
  value: {{ .Values.logging.level | quote }}
- name: GPUSLICE_LOG_FORMAT
  value: {{ .Values.logging.format | quote }}
- name: GPUSLICE_CATALOG_FILES
  value: {{ include "gpuslice.catalogFiles" . | quote }}
{{- end }}

{{/* Volume and mount of the catalog overrides (callers add them only when there are any). */}}
{{- define "gpuslice.catalogVolume" -}}
- name: catalog
  configMap:
    name: {{ include "gpuslice.catalogConfigMap" . }}
{{- end }}

{{- define "gpuslice.catalogVolumeMount" -}}
- name: catalog
  mountPath: {{ include "gpuslice.catalogDir" . }}
  readOnly: true
{{- end }}

{{/* True (non-empty) when the cluster serves admissionregistration.k8s.io/v1 policies. */}}
{{- define "gpuslice.admissionPolicySupported" -}}
{{- if semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version }}true{{ end }}
{{- end }}

{{/* Checks the schema cannot express (relations between values); renders nothing. */}}
{{- define "gpuslice.validate" -}}
{{- $b := .Values.partitioner.batch }}
{{- if gt (float64 $b.idleSeconds) (float64 $b.timeoutSeconds) }}
{{- fail (printf "partitioner.batch.idleSeconds (%v) must not exceed partitioner.batch.timeoutSeconds (%v): the idle window closes a batch early, the timeout bounds it" $b.idleSeconds $b.timeoutSeconds) }}
{{- end }}
{{- $stale := float64 .Values.partitioner.liveness.staleSeconds }}
{{- $least := addf 1 (float64 .Values.partitioner.planner.timeLimitSeconds) }}
{{- if and (gt $stale 0.0) (le $stale $least) }}
{{- fail (printf "partitioner.liveness.staleSeconds (%v) must exceed partitioner.planner.timeLimitSeconds (%v) plus the 1 s cycle, the least time between two decision steps (or be 0: never stale); the partitioner refuses it at start" .Values.partitioner.liveness.staleSeconds .Values.partitioner.planner.timeLimitSeconds) }}
{{- end }}
{{- if eq (int .Values.partitioner.metricsPort) (int .Values.partitioner.healthPort) }}
{{- fail (printf "partitioner.metricsPort and partitioner.healthPort are both %v: give them different ports" .Values.partitioner.metricsPort) }}
{{- end }}
{{- $wp := int .Values.webhook.port }}
{{- if or (eq $wp (int .Values.partitioner.metricsPort)) (eq $wp (int .Values.partitioner.healthPort)) }}
{{- fail (printf "webhook.port (%v) must differ from partitioner.metricsPort and partitioner.healthPort" .Values.webhook.port) }}
{{- end }}
{{- /* also where the schema is skipped (helm --skip-schema-validation): one agent per node */}}
{{- $surge := dig "updateStrategy" "rollingUpdate" "maxSurge" "" .Values.agent }}
{{- if and (ne (toString $surge) "") (not (regexMatch "^0+%?$" (toString $surge))) }}
{{- fail (printf "agent.updateStrategy.rollingUpdate.maxSurge (%v) must be 0 or unset: a surge runs a second agent on each GPU node beside the old one during a rollout, both registering the device plugin and changing the same GPUs through NVML; roll the agents with maxUnavailable instead" $surge) }}
{{- end }}
{{- end }}

{{/* True (non-empty) when the admission webhook is rendered: enabled, reservations on, and
Kubernetes >= 1.30 (matchConditions and mutable scheduling directives of gated pods are GA
there).  With partitioner.reservations.enabled=false nothing ever releases a gated pod (the
partitioner only removes the gate again), so gating at admission would cost every slice pod a
cycle for nothing: no MutatingWebhookConfiguration, Service or certificate, and the partitioner
serves no webhook (GPUSLICE_WEBHOOK_ENABLED unset). */}}
{{/* The partitioner plans DRA nodes and gates pods naming ResourceClaims: dra.enabled with
planner-shaped publishing. With dra.publish=all the agents publish every placement and read no
spec, so the partitioner leaves DRA nodes and claim pods alone (kube-scheduler allocates
first-fit); gating those pods would keep them gated for good. */}}
{{- define "gpuslice.draPlanned" -}}
{{- if and .Values.dra.enabled (ne (.Values.dra.publish | default "shaped") "all") }}true{{ end }}
{{- end }}

{{- define "gpuslice.webhookEnabled" -}}
{{- if and .Values.webhook.enabled .Values.partitioner.reservations.enabled (include "gpuslice.admissionPolicySupported" .) }}true{{ end }}
{{- end }}

{{/* The webhook's Service and MutatingWebhookConfiguration (one name, two kinds). */}}
{{- define "gpuslice.webhookName" -}}
{{ include "gpuslice.componentName" (list . "webhook") }}
{{- end }}

{{/* The Secret holding the webhook's serving certificate (either mode). */}}
{{- define "gpuslice.webhookSecret" -}}
{{ include "gpuslice.componentName" (list . "webhook-tls") }}
{{- end }}

{{/* Where the partitioner finds the cert-manager Secret's files. */}}
{{- define "gpuslice.webhookCertDir" -}}/etc/gpuslice/webhook-tls{{- end }}
