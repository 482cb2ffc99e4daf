{{/* Names, labels and small shared pieces. */}}

{{- define "pd-cluster.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pd-cluster.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pd-cluster.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries. Call with (dict "root" $ "component" "router"). */}}
{{- define "pd-cluster.labels" -}}
helm.sh/chart: {{ include "pd-cluster.chart" .root }}
{{ include "pd-cluster.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pd-cluster
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The labels the router's pod selectors, Services and PDBs match. */}}
{{- define "pd-cluster.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pd-cluster.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end }}

{{/* The router's --*-selector flag value for a role, KEY=VALUE pairs. */}}
{{- define "pd-cluster.roleSelector" -}}
{{- $labels := include "pd-cluster.selectorLabels" . | fromYaml }}
{{- $pairs := list }}
{{- range $k, $v := $labels }}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) }}
{{- end }}
{{- toJson $pairs }}
{{- end }}

{{- define "pd-cluster.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{- define "pd-cluster.serviceAccountName" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (printf "%s-router" (include "pd-cluster.fullname" .)) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pd-cluster.authSecretName" -}}
{{- default (printf "%s-router-auth" (include "pd-cluster.fullname" .)) .Values.router.auth.existingSecret }}
{{- end }}

{{/*
Command-line flags from a map, as YAML list items. Keys are flag names without "--".
true: the bare flag; false or null: left out; a list: the flag then each item; else flag and value.
Whole numbers print without an exponent (values arrive as float64).
*/}}
{{- define "pd-cluster.flags" -}}
{{- range $k, $v := . }}
{{- if kindIs "bool" $v }}
{{- if $v }}
- {{ printf "--%s" $k | quote }}
{{- end }}
{{- else if kindIs "invalid" $v }}
{{- else if kindIs "slice" $v }}
- {{ printf "--%s" $k | quote }}
{{- range $v }}
- {{ include "pd-cluster.scalar" . | quote }}
{{- end }}
{{- else }}
- {{ printf "--%s" $k | quote }}
- {{ include "pd-cluster.scalar" $v | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pd-cluster.scalar" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{/* An HTTP probe from {path, periodSeconds, timeoutSeconds, failureThreshold} on the named port "http". */}}
{{- define "pd-cluster.probe" -}}
httpGet:
  path: {{ .path }}
  port: http
periodSeconds: {{ .periodSeconds }}
timeoutSeconds: {{ .timeoutSeconds }}
failureThreshold: {{ .failureThreshold }}
{{- end }}

{{/* Maps merged recursively: `over`'s keys win; maps merge, other values (lists included) replace. */}}
{{- define "pd-cluster.deepMerge" -}}
{{- $out := deepCopy (.base | default dict) }}
{{- range $k, $v := .over }}
{{- $b := index $out $k }}
{{- if and (kindIs "map" $v) (kindIs "map" $b) }}
{{- $_ := set $out $k (include "pd-cluster.deepMerge" (dict "base" $b "over" $v) | fromJson) }}
{{- else }}
{{- $_ := set $out $k $v }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* One worker role's settings: `workers` with the role's own block merged over it. */}}
{{- define "pd-cluster.roleValues" -}}
{{- include "pd-cluster.deepMerge" (dict "base" .root.Values.workers "over" (index .root.Values .role)) }}
{{- end }}

{{/* Engine flags of a role: engine.args with the role's args laid over. */}}
{{- define "pd-cluster.roleArgs" -}}
{{- include "pd-cluster.deepMerge" (dict "base" .root.Values.engine.args "over" (index .root.Values .role).args) }}
{{- end }}

{{/* GPUs per worker pod: gpu.count, else tp-size divided by the LeaderWorkerSet group size. */}}
{{- define "pd-cluster.gpuCount" -}}
{{- $w := .values }}
{{- if not (kindIs "invalid" .root.Values.gpu.count) }}
{{- .root.Values.gpu.count | int }}
{{- else }}
{{- $tp := (get .args "tp-size") | default 1 | int }}
{{- $pods := ternary ($w.leaderWorkerSet.size | int) 1 $w.leaderWorkerSet.enabled }}
{{- if ne (mod $tp $pods) 0 }}
{{- fail (printf "%s: tp-size %d is not a multiple of leaderWorkerSet.size %d" .role $tp $pods) }}
{{- end }}
{{- div $tp $pods }}
{{- end }}
{{- end }}

{{/* The roles that are enabled, in a fixed order. */}}
{{- define "pd-cluster.roles" -}}
{{- $roles := list }}
{{- range $r := list "prefill" "decode" "mixed" }}
{{- if (index $.Values $r).enabled }}
{{- $roles = append $roles $r }}
{{- end }}
{{- end }}
{{- toJson $roles }}
{{- end }}

{{/*
The folder the router loads its tokenizer from (--tokenizer-path), or "" for none: router.tokenizerFromModel
not true (null, the default, means off: the router learns the workers' text-to-page maps), the router's args or extraArgs name one already, or model.source=embedded (a folder inside the installed
package, which the chart cannot name). Otherwise the tokenizer the workers load: the decode (else mixed) role's
`tokenizer` flag, else model.path.
*/}}
{{- define "pd-cluster.routerTokenizer" -}}
{{- $r := .Values.router }}
{{- $named := index ($r.args | default dict) "tokenizer-path" }}
{{- range $r.extraArgs }}
{{- if regexMatch "^--tokenizer(-path)?(=|$)" (toString .) }}{{ $named = true }}{{ end }}
{{- end }}
{{- $on := $r.tokenizerFromModel }}
{{- if kindIs "invalid" $on }}{{ $on = false }}{{ end }}
{{- if and $on (not $named) (ne .Values.model.source "embedded") }}
{{- $tok := "" }}
{{- range $role := list "decode" "mixed" }}
{{- if and (not $tok) (index $.Values $role).enabled }}
{{- $tok = get (include "pd-cluster.roleArgs" (dict "root" $ "role" $role) | fromJson) "tokenizer" }}
{{- end }}
{{- end }}
{{- $tok | default .Values.model.path }}
{{- end }}
{{- end }}

{{/* The model volume's mount (read-only), for a source that is a volume (pvc, hostPath, imageVolume). */}}
{{- define "pd-cluster.modelVolumeMount" -}}
{{- $m := .Values.model }}
{{- if has $m.source (list "pvc" "hostPath" "imageVolume") }}
- name: model
  mountPath: {{ $m.mountPath }}
  readOnly: true
  {{- if and (eq $m.source "pvc") $m.pvc.subPath }}
  subPath: {{ $m.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}
