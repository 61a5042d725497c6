{{/*
Names, labels and the pieces of the workers' command line shared by the templates.
Numbers from values files arrive as float64: every number is passed through `int` before use.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "distlib.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The prefix of every object name: fullnameOverride, else "<release>" when the release name
already contains the chart name, else "<release>-<chart name>".
*/}}
{{- define "distlib.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "distlib-0.1.0": the helm.sh/chart label. */}}
{{- define "distlib.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels; call with (dict "ctx" $ "component" "master"|"worker"). */}}
{{- define "distlib.selectorLabels" -}}
app.kubernetes.io/name: {{ include "distlib.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The standard labels of every object; call with (dict "ctx" $ "component" ...). */}}
{{- define "distlib.labels" -}}
helm.sh/chart: {{ include "distlib.chart" .ctx }}
{{ include "distlib.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: distlib
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end -}}

{{/* The master Deployment and its Service (tcp mode). */}}
{{- define "distlib.master.name" -}}
{{- printf "%s-master" (include "distlib.fullname" . | trunc 56 | trimSuffix "-") -}}
{{- end -}}

{{/*
The claim that holds the master's state directory: master.persistence.existingClaim, else the
chart's "<fullname>-master-state" (cut, as the master's name, to fit 63 characters).
*/}}
{{- define "distlib.master.stateClaim" -}}
{{- .Values.master.persistence.existingClaim | default (printf "%s-master-state" (include "distlib.fullname" . | trunc 50 | trimSuffix "-")) -}}
{{- end -}}

{{/*
The workers' Indexed Job and its headless Service (the same name). A pod's hostname is
"<job name>-<index>" and must fit a DNS label (63): the prefix is cut to leave room for the
"-workers-" suffix and the digits of the largest index.
*/}}
{{- define "distlib.workers.name" -}}
{{- $digits := len (toString (sub (int .Values.nodes) 1)) -}}
{{- $room := sub 63 (add 9 $digits) -}}
{{- printf "%s-workers" (include "distlib.fullname" . | trunc (int $room) | trimSuffix "-") -}}
{{- end -}}

{{/* "<ns>.svc.<cluster domain>": the suffix of every in-cluster DNS name. */}}
{{- define "distlib.dnsSuffix" -}}
{{- printf "%s.svc.%s" .Release.Namespace (.Values.clusterDomain | trimSuffix ".") -}}
{{- end -}}

{{/* The store endpoint "host:port" in tcp mode: the master Service, or master.externalEndpoint. */}}
{{- define "distlib.master.endpoint" -}}
{{- if .Values.master.externalEndpoint -}}
{{- .Values.master.externalEndpoint -}}
{{- else -}}
{{- printf "%s.%s:%d" (include "distlib.master.name" .) (include "distlib.dnsSuffix" .) (int .Values.masterPort) -}}
{{- end -}}
{{- end -}}

{{/* True ("true") when this release deploys its own master Deployment and Service. */}}
{{- define "distlib.master.enabled" -}}
{{- if and (eq .Values.mode "tcp") (not .Values.master.externalEndpoint) -}}true{{- end -}}
{{- end -}}

{{/* The DNS name of the worker with completion index 0 (rank0 mode's store host). */}}
{{- define "distlib.rank0.host" -}}
{{- $workers := include "distlib.workers.name" . -}}
{{- printf "%s-0.%s.%s" $workers $workers (include "distlib.dnsSuffix" .) -}}
{{- end -}}

{{/* The image reference. */}}
{{- define "distlib.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) -}}
{{- end -}}

{{/*
The run id every pod of one install shares. An explicit runId is used as it is; the default is
"<release>-<revision>-$(DISTLIB_JOB_UID)", which the kubelet expands from the Job's uid (set in
the env before DISTLIB_RUN_ID), so it differs for every install.
*/}}
{{- define "distlib.runId" -}}
{{- if .Values.runId -}}
{{- .Values.runId -}}
{{- else -}}
{{- printf "%s-%d-$(DISTLIB_JOB_UID)" .Release.Name (int .Release.Revision) -}}
{{- end -}}
{{- end -}}

{{/*
The shared token (auth.enabled): the Secret that holds it (the chart's own "<fullname>-auth",
or auth.existingSecret) and its key there.
*/}}
{{- define "distlib.auth.secretName" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecret -}}
{{- else -}}
{{- printf "%s-auth" (include "distlib.fullname" . | trunc 58 | trimSuffix "-") -}}
{{- end -}}
{{- end -}}

{{- define "distlib.auth.secretKey" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecretKey | default "token" -}}
{{- else -}}
token
{{- end -}}
{{- end -}}

{{/* Where every container that serves or joins the store reads the token. */}}
{{- define "distlib.auth.path" -}}
/run/secrets/distlib/token
{{- end -}}

{{/* The pod volume of the token: group-readable (0440); the kubelet gives the file the group
podSecurityContext.fsGroup (1000, the image's user's), so the containers can read it. */}}
{{- define "distlib.auth.volume" -}}
- name: auth-token
  secret:
    secretName: {{ include "distlib.auth.secretName" . | quote }}
    defaultMode: 0440
    items:
      - key: {{ include "distlib.auth.secretKey" . | quote }}
        path: {{ include "distlib.auth.path" . | base | quote }}
{{- end -}}

{{/* The container's read-only mount of that volume. */}}
{{- define "distlib.auth.mount" -}}
- name: auth-token
  mountPath: {{ include "distlib.auth.path" . | dir | quote }}
  readOnly: true
{{- end -}}

{{/* The container's variable that names the token file (never the token itself). */}}
{{- define "distlib.auth.env" -}}
- name: DISTLIB_AUTH_TOKEN_FILE
  value: {{ include "distlib.auth.path" . | quote }}
{{- end -}}

{{/* Checks the schema cannot express with a clear message; included by the Job. */}}
{{- define "distlib.validate" -}}
{{- if .Values.elastic.enabled -}}
{{- if eq .Values.mode "rank0" -}}
{{- fail "elastic.enabled with mode \"rank0\": pod 0 hosts the store in rank0 mode, and losing it would lose the job; use mode tcp (the master service) or file" -}}
{{- end -}}
{{- $max := .Values.elastic.maxReplicas | default .Values.nodes -}}
{{- if gt (int .Values.elastic.minReplicas) (int $max) -}}
{{- fail (printf "elastic.minReplicas (%d) is larger than elastic.maxReplicas (%d)" (int .Values.elastic.minReplicas) (int $max)) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.auth.enabled .Values.master.externalEndpoint (eq .Values.mode "tcp") (not .Values.auth.existingSecret) -}}
{{- fail "master.externalEndpoint with auth.enabled: the shared store server has a token of its own, which a token made by this chart cannot match; put it in a Secret and set auth.existingSecret (and auth.existingSecretKey), or set auth.enabled=false for a server without a token" -}}
{{- end -}}
{{- if eq .Values.mode "file" -}}
{{- $nfs := or .Values.file.nfs.server .Values.file.nfs.path -}}
{{- if and (not .Values.file.existingClaim) (not $nfs) -}}
{{- fail "mode \"file\" needs a ReadWriteMany volume: set file.existingClaim, or file.nfs.server and file.nfs.path" -}}
{{- end -}}
{{- if and .Values.file.existingClaim $nfs -}}
{{- fail "mode \"file\": set file.existingClaim or file.nfs, not both" -}}
{{- end -}}
{{- if and $nfs (not (and .Values.file.nfs.server .Values.file.nfs.path)) -}}
{{- fail "mode \"file\": file.nfs needs both server and path" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The environment of the worker containers (and of file mode's init container). Order matters:
the kubelet expands $(VAR) only from variables defined earlier in the list.
*/}}
{{- define "distlib.workers.env" -}}
{{- /* The Job controller adds JOB_COMPLETION_INDEX too (when absent); defined here, it is
  there for $(JOB_COMPLETION_INDEX) in the args whatever the controller does. */}}
- name: JOB_COMPLETION_INDEX
  valueFrom:
    fieldRef:
      fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
- name: DISTLIB_JOB_UID
  valueFrom:
    fieldRef:
      fieldPath: metadata.labels['batch.kubernetes.io/controller-uid']
- name: DISTLIB_RUN_ID
  value: {{ include "distlib.runId" . | quote }}
- name: DISTLIB_BACKEND
  value: {{ .Values.backend | quote }}
{{- if and (eq .Values.mode "file") (not .Values.elastic.enabled) }}
- name: DISTLIB_INIT_METHOD
  value: {{ printf "file://%s/$(DISTLIB_RUN_ID)/store" (.Values.file.mountPath | trimSuffix "/") | quote }}
{{- end }}
{{- with .Values.network.socketIfname }}
- name: GLOO_SOCKET_IFNAME
  value: {{ . | quote }}
{{- end }}
{{- with .Values.network.portRange }}
- name: DISTLIB_PORT_RANGE
  value: {{ . | quote }}
{{- end }}
- name: PYTHONUNBUFFERED
  value: "1"
{{- end -}}
