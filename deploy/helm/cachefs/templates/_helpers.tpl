{{/*
Written by hand (scripts/helm_chart.py generates the other templates and names these helpers).
*/}}

{{/* The labels Helm's convention puts on every object, in its own metadata only. */}}
{{- define "cachefs.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The cachefs image: repository:tag. */}}
{{- define "cachefs.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end }}
