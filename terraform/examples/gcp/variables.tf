variable "project_id" {
  description = "GCP project for the fleet."
  type        = string
}

variable "region" {
  description = "Region of the fleet."
  type        = string
  default     = "us-central1"
}

variable "zones" {
  description = "Zones in region that offer the GPU (L4 for g2)."
  type        = list(string)
  default     = ["us-central1-a", "us-central1-b", "us-central1-c"]
}

variable "subnetwork" {
  description = "Subnetwork with Cloud NAT and Private Google Access."
  type        = string
}

variable "bucket_name" {
  description = "Globally unique name for the checkpoint bucket this example creates."
  type        = string
}

variable "peer_token_secret" {
  description = "Secret Manager secret (projects/PROJECT/secrets/NAME) holding the job's peer token; null leaves the peer tier off."
  type        = string
  default     = null
}
