{{/*
The pod template of a worker role.
Call with (dict "root" $ "role" "prefill" "values" <roleValues> "args" <roleArgs> "lws" ""|"leader"|"worker").
Serving pods (StatefulSet pods, LWS leaders) carry app.kubernetes.io/component=<role>, which the
router's discovery selector matches; other LWS group members carry <role>-lws-worker.
*/}}
{{- define "pd-cluster.workerPod" -}}
{{- $root := .root }}
{{- $w := .values }}
{{- $component := ternary (printf "%s-lws-worker" .role) .role (eq .lws "worker") }}
metadata:
  labels:
    {{- include "pd-cluster.labels" (dict "root" $root "component" $component) | nindent 4 }}
    {{- with $w.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    pd-cluster.io/port: {{ $w.port | quote }}
    kubectl.kubernetes.io/default-container: worker
    {{- with $w.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  automountServiceAccountToken: false
  enableServiceLinks: false
  {{- if $w.hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  terminationGracePeriodSeconds: {{ add $w.drainSeconds $w.preStopSleepSeconds 30 }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $w.schedulerName }}
  schedulerName: {{ . }}
  {{- end }}
  {{- with $w.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml $w.podSecurityContext | nindent 4 }}
  {{- with $w.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $affinity := include "pd-cluster.workerAffinity" (dict "root" $root "values" $w) | fromYaml }}
  {{- with $affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: worker
      image: {{ include "pd-cluster.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command: ["pd-worker"]
      args:
        - "--role"
        - {{ .role | quote }}
        - "--host"
        - "0.0.0.0"
        - "--port"
        - {{ $w.port | quote }}
        - "--advertise-url"
        - {{ printf "http://$(POD_IP):%v" $w.port | quote }}
        - "--log-level"
        - {{ $w.logLevel | quote }}
        - "--timeout-graceful-shutdown"
        - {{ $w.drainSeconds | quote }}
        {{- if ne $root.Values.model.source "embedded" }}
        - "--model"
        - {{ $root.Values.model.path | quote }}
        {{- end }}
        {{- include "pd-cluster.flags" .args | trim | nindent 8 }}
        {{- if and (or $root.Values.kvStore.enabled (index .args "hicache-storage-backend")) (gt ((index .args "tp-size") | default 1 | int) 1) }}
        {{- fail (printf "%s: the KV store (kvStore.enabled or hicache-storage-backend) is not built for tp-size > 1 yet; set %s.args.tp-size: 1 or turn the store off" .role .role) }}
        {{- end }}
        {{- if and $root.Values.kvStore.enabled (not (index .args "hicache-storage-backend")) }}
        - "--hicache-storage-backend"
        - "mooncake"
        {{- end }}
        {{- if .lws }}
        {{- range $w.leaderWorkerSet.args }}
        - {{ . | quote }}
        {{- end }}
        {{- end }}
        {{- range $w.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      ports:
        - name: http
          containerPort: {{ $w.port }}
          protocol: TCP
      env:
        {{- include "pd-cluster.workerEnv" (dict "root" $root "values" $w) | trim | nindent 8 }}
      resources:
        {{- include "pd-cluster.workerResources" . | nindent 8 }}
      securityContext:
        {{- $sc := deepCopy $w.securityContext }}
        {{- if and $root.Values.rdma.enabled $root.Values.rdma.ipcLock }}
        {{- $caps := deepCopy ($sc.capabilities | default dict) }}
        {{- $_ := set $caps "add" (append ($caps.add | default list) "IPC_LOCK" | uniq) }}
        {{- $_ := set $sc "capabilities" $caps }}
        {{- end }}
        {{- toYaml $sc | nindent 8 }}
      startupProbe:
        {{- include "pd-cluster.probe" $w.startupProbe | nindent 8 }}
      readinessProbe:
        {{- include "pd-cluster.probe" $w.readinessProbe | nindent 8 }}
      livenessProbe:
        {{- include "pd-cluster.probe" $w.livenessProbe | nindent 8 }}
      lifecycle:
        preStop:
          sleep:
            seconds: {{ $w.preStopSleepSeconds }}
      volumeMounts:
        - name: shm
          mountPath: /dev/shm
        - name: tmp
          mountPath: /tmp
        - name: cache
          mountPath: /cache
        {{- include "pd-cluster.modelVolumeMount" $root | trim | nindent 8 }}
        {{- with $w.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $w.shmSize }}
    - name: tmp
      emptyDir:
        sizeLimit: 1Gi
    - name: cache
      emptyDir:
        sizeLimit: {{ $w.cacheSize }}
    {{- include "pd-cluster.modelVolume" $root | trim | nindent 4 }}
    {{- with $w.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{- define "pd-cluster.workerEnv" -}}
{{- $root := .root }}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: PYTHONUNBUFFERED
  value: "1"
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /cache
- name: TRITON_CACHE_DIR
  value: /cache/triton
- name: HF_HOME
  value: {{ $root.Values.model.hfHome | quote }}
{{- if $root.Values.model.hfHubOffline }}
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}
{{- with $root.Values.model.hfTokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $root.Values.model.hfTokenSecret.key }}
{{- end }}
{{- range $k, $v := $root.Values.ucx.env }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
- name: PD_INTERNAL_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "pd-cluster.fullname" $root }}-internal-key
      key: internal-api-key
{{- with $root.Values.kvStore }}
{{- if .enabled }}
- name: MOONCAKE_MASTER
  value: {{ printf "%s-kv-master:%v" (include "pd-cluster.fullname" $root) .rpcPort | quote }}
- name: MOONCAKE_LOCAL_HOSTNAME
  value: "$(POD_IP)"
- name: MOONCAKE_PROTOCOL
  value: {{ .protocol | quote }}
{{- with .deviceName }}
- name: MOONCAKE_DEVICE
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- with .values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pd-cluster.workerResources" -}}
{{- $root := .root }}
{{- $res := deepCopy (.values.resources | default dict) }}
{{- $limits := $res.limits | default dict }}
{{- $requests := $res.requests | default dict }}
{{- $gpus := include "pd-cluster.gpuCount" . | int }}
{{- if gt $gpus 0 }}
{{- $_ := set $limits $root.Values.gpu.resourceName $gpus }}
{{- $_ := set $requests $root.Values.gpu.resourceName $gpus }}
{{- end }}
{{- if $root.Values.rdma.enabled }}
{{- $_ := set $limits $root.Values.rdma.resourceName ($root.Values.rdma.count | int) }}
{{- $_ := set $requests $root.Values.rdma.resourceName ($root.Values.rdma.count | int) }}
{{- end }}
{{- if $limits }}{{ $_ := set $res "limits" $limits }}{{ end }}
{{- if $requests }}{{ $_ := set $res "requests" $requests }}{{ end }}
{{- toYaml $res }}
{{- end }}

{{- define "pd-cluster.modelVolume" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source=pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source=hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "imageVolume" }}
{{- if not (semverCompare ">=1.33.0-0" .Capabilities.KubeVersion.Version) }}
{{- fail (printf "model.source=imageVolume needs Kubernetes 1.33+ (image volumes; the ImageVolume feature gate must be on before 1.35), this cluster is %s: use model.source=pvc or hostPath" .Capabilities.KubeVersion.Version) }}
{{- end }}
- name: model
  image:
    reference: {{ required "model.imageVolume.reference is required with model.source=imageVolume" $m.imageVolume.reference }}
    pullPolicy: {{ $m.imageVolume.pullPolicy }}
{{- end }}
{{- end }}

{{/* The worker pods' affinity: the user's, plus the anti-affinity preset when none is given. */}}
{{- define "pd-cluster.workerAffinity" -}}
{{- $w := .values }}
{{- $aff := deepCopy ($w.affinity | default dict) }}
{{- if and (ne $w.antiAffinity "none") (not (hasKey $aff "podAntiAffinity")) }}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchExpressions" (list
      (dict "key" "app.kubernetes.io/instance" "operator" "In" "values" (list .root.Release.Name))
      (dict "key" "app.kubernetes.io/component" "operator" "In" "values" (include "pd-cluster.workerComponents" . | fromJsonArray)))) }}
{{- if eq $w.antiAffinity "hard" }}
{{- $_ := set $aff "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) }}
{{- else }}
{{- $_ := set $aff "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) }}
{{- end }}
{{- end }}
{{- toYaml $aff }}
{{- end }}

{{/* Every component value a worker pod of any role can carry. */}}
{{- define "pd-cluster.workerComponents" -}}
{{- $out := list }}
{{- range $r := list "prefill" "decode" "mixed" }}
{{- $out = append $out $r }}
{{- $out = append $out (printf "%s-lws-worker" $r) }}
{{- end }}
{{- toJson $out }}
{{- end }}
