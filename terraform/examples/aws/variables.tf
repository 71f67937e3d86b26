variable "region" {
  description = "AWS region of the fleet."
  type        = string
  default     = "us-east-1"
}

variable "ami_id" {
  description = "AMI for the training VMs, e.g. the current AWS Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets (with a NAT or an S3 gateway endpoint), one per Availability Zone."
  type        = list(string)
}

variable "bucket_name" {
  description = "Globally unique name for the checkpoint bucket this example creates."
  type        = string
}

variable "peer_token_secret_arn" {
  description = "Secrets Manager secret holding the job's peer token; null leaves the peer tier off."
  type        = string
  default     = null
}
