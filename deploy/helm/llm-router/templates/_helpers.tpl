{{/* Common labels; `component` is worker, scheduler or gateway. */}}
{{- define "llm-router.labels" -}}
app.kubernetes.io/name: llm-router
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "llm-router.selector" -}}
app.kubernetes.io/name: llm-router
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Resource name: <release>-<component>, e.g. prod-worker. */}}
{{- define "llm-router.name" -}}
{{ printf "%s-%s" .root.Release.Name .component | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "llm-router.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end -}}

{{- define "llm-router.podAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- with .scheme }}
prometheus.io/scheme: {{ . }}
{{- end }}
{{- end }}
{{- end -}}
