variable "name" {
  description = "Name prefix for every resource; also the service account id, so 6-28 characters."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,26}[a-z0-9]$", var.name))
    error_message = "name must be 6-28 lowercase letters, digits or '-', starting with a letter."
  }
}

variable "project_id" {
  description = "GCP project that owns the fleet, service account and bucket."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "project_id must be a valid GCP project id."
  }
}

variable "region" {
  description = "Region of the regional managed instance group."
  type        = string
}

variable "zones" {
  description = "Zones (in region) with the GPU type available. Several zones make Spot capacity far more available."
  type        = list(string)

  validation {
    condition     = length(var.zones) >= 1
    error_message = "zones must list at least one zone."
  }
}

variable "machine_type" {
  description = "Machine type, e.g. g2-standard-8 (L4) or a2-highgpu-1g (A100)."
  type        = string
}

variable "gpu_type" {
  description = "Accelerator type to attach for machine types without built-in GPUs (e.g. nvidia-tesla-t4 on n1); null for none (a2/a3/g2 include theirs)."
  type        = string
  default     = null
}

variable "gpu_count" {
  description = "Number of gpu_type accelerators; ignored when gpu_type is null."
  type        = number
  default     = 1

  validation {
    condition     = contains([1, 2, 4, 8, 16], var.gpu_count)
    error_message = "gpu_count must be 1, 2, 4, 8 or 16."
  }
}

variable "source_image" {
  description = "Boot image, e.g. a Deep Learning VM image (projects/deeplearning-platform-release/global/images/family/...). Needs python3 and systemd."
  type        = string
}

variable "boot_disk_size_gb" {
  description = "Boot disk size in GB."
  type        = number
  default     = 200

  validation {
    condition     = var.boot_disk_size_gb >= 10
    error_message = "boot_disk_size_gb must be >= 10."
  }
}

variable "disk_kms_key_self_link" {
  description = "Cloud KMS key (self link) for the boot disk; null uses Google-managed encryption (encrypted either way)."
  type        = string
  default     = null
}

variable "local_ssd_count" {
  description = "Local NVMe SSDs (375 GB each) for the checkpoint root; 0 for none. Local SSD dies with the VM; spotguard uploads before it does."
  type        = number
  default     = 1

  validation {
    condition     = var.local_ssd_count >= 0 && var.local_ssd_count <= 24
    error_message = "local_ssd_count must be between 0 and 24."
  }
}

variable "subnetwork" {
  description = "Subnetwork self link or name for the instances. They get no external IP: give the subnet Cloud NAT and Private Google Access."
  type        = string
}

variable "network_tags" {
  description = "Network tags for firewall rules."
  type        = list(string)
  default     = []
}

variable "target_size" {
  description = "Number of training VMs the managed instance group keeps."
  type        = number
  default     = 1

  validation {
    condition     = var.target_size >= 0
    error_message = "target_size must be >= 0."
  }
}

variable "termination_action" {
  description = "What GCP does to a preempted Spot VM: DELETE (the group recreates it; local SSD is lost either way) or STOP."
  type        = string
  default     = "DELETE"

  validation {
    condition     = contains(["DELETE", "STOP"], var.termination_action)
    error_message = "termination_action must be DELETE or STOP."
  }
}

variable "enable_secure_boot" {
  description = "Shielded VM Secure Boot. Needs signed GPU drivers (Deep Learning VM images have them); vTPM and integrity monitoring are always on."
  type        = bool
  default     = true
}

variable "create_bucket" {
  description = "Create the checkpoint bucket (uniform access, public access prevented, versioned). false: use an existing bucket named bucket_name, which must have uniform bucket-level access (IAM conditions need it)."
  type        = bool
  default     = true
}

variable "bucket_name" {
  description = "GCS bucket for checkpoints (created when create_bucket is true)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be a valid GCS bucket name."
  }
}

variable "bucket_location" {
  description = "Location of a created bucket; use the fleet's region so uploads stay in-region and fast."
  type        = string
  default     = "US"
}

variable "bucket_kms_key_name" {
  description = "Cloud KMS key for a created bucket's default encryption (CMEK); null for Google-managed keys."
  type        = string
  default     = null
}

variable "checkpoint_prefix" {
  description = "Object prefix for this run's checkpoints. The service account may read and write only objects under it."
  type        = string
  default     = "spotguard"

  validation {
    condition     = can(regex("^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$", var.checkpoint_prefix))
    error_message = "checkpoint_prefix must be non-empty, without leading or trailing '/'."
  }
}

variable "noncurrent_version_expiration_days" {
  description = "Days a deleted or overwritten checkpoint object is kept as a noncurrent version."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be >= 1."
  }
}

variable "spotguard_package" {
  description = "pip requirement installed on the VMs, pinned."
  type        = string
  default     = "spotguard[gcp]==0.1.0"

  validation {
    condition     = can(regex("^[A-Za-z0-9_.\\[\\],<>=!~ +:/@-]+$", var.spotguard_package))
    error_message = "spotguard_package must be a pip requirement without quotes or shell metacharacters."
  }
}

variable "checkpoint_dir" {
  description = "Local checkpoint root shared by spotguard and the trainer. Put it under local_nvme_mount to use Local SSD."
  type        = string
  default     = "/mnt/nvme/spotguard"

  validation {
    condition     = can(regex("^/[A-Za-z0-9._/-]+$", var.checkpoint_dir))
    error_message = "checkpoint_dir must be an absolute path of letters, digits, '.', '_', '-' and '/'."
  }
}

variable "local_nvme_mount" {
  description = "Where to mount the first Local SSD (formatted ext4 at boot); empty to not mount one."
  type        = string
  default     = "/mnt/nvme"

  validation {
    condition     = var.local_nvme_mount == "" || can(regex("^/[A-Za-z0-9._/-]+$", var.local_nvme_mount))
    error_message = "local_nvme_mount must be empty or an absolute path."
  }
}

variable "trainer_user" {
  description = "Unix user the trainer runs as (created if missing). It runs with group spotguard to reach the daemon's socket."
  type        = string
  default     = "trainer"

  validation {
    condition     = can(regex("^[a-z_][a-z0-9_-]{0,31}$", var.trainer_user))
    error_message = "trainer_user must be a valid Unix user name."
  }
}

variable "trainer_command" {
  description = "ExecStart= of trainer.service: an absolute path and its arguments, systemd quoting. The script should use spotguard.Guard (pip install 'spotguard[torch]')."
  type        = string

  validation {
    condition     = startswith(var.trainer_command, "/") && !strcontains(var.trainer_command, "\n")
    error_message = "trainer_command must be one line starting with an absolute path."
  }
}

variable "trainer_environment" {
  description = "Extra environment for trainer.service (written to /etc/spotguard/trainer.env). SPOTGUARD_SOCKET, SPOTGUARD_CHECKPOINT_DIR and SPOTGUARD_BUCKET are set already."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k, v in var.trainer_environment : can(regex("^[A-Za-z_][A-Za-z0-9_]*$", k)) && !strcontains(v, "\n")])
    error_message = "trainer_environment keys must be environment variable names and values single lines."
  }
}

variable "extra_config" {
  description = "Extra lines appended to /etc/spotguard/spotguard.toml. See systemd/spotguard.toml.example."
  type        = string
  default     = ""
}

variable "labels" {
  description = "Labels for the instances, disks and bucket."
  type        = map(string)
  default     = {}
}

# --- the peer tier ----------------------------------------------------------------------

variable "enable_peers" {
  description = "Run spotguard's peer tier: each VM's daemon listens on peer_port, registers under the bucket's .spotguard-peers/ (peers = \"bucket\") and, when an urgent checkpoint cannot reach the bucket before the deadline, hands it to another VM of the group, which commits it there. Needs peer_token_secret."
  type        = bool
  default     = false
}

variable "peer_port" {
  description = "TCP port the daemons take each other's checkpoints on; a firewall rule opens it only between VMs carrying the fleet's peer network tag."
  type        = number
  default     = 7140

  validation {
    condition     = var.peer_port >= 1024 && var.peer_port <= 65535
    error_message = "peer_port must be between 1024 and 65535."
  }
}

variable "peer_token_secret" {
  description = "Secret Manager secret holding the job's peer token, as projects/PROJECT/secrets/NAME (at least 16 bytes, e.g. openssl rand -hex 32). Created outside this module, so the token never sits in Terraform state; the service account gets secretAccessor on this secret only."
  type        = string
  default     = null

  validation {
    condition     = var.peer_token_secret == null || can(regex("^projects/[^/]+/secrets/[A-Za-z0-9_-]+$", var.peer_token_secret))
    error_message = "peer_token_secret must be projects/PROJECT/secrets/NAME."
  }
}

variable "peer_token_accept_previous" {
  description = "While the job's peer token is rotated: each daemon also accepts the Secret Manager secret's version before the latest, while it is enabled (read at boot), so VMs started before and after the rotation stay peers. Leave false after a rotation forced by a compromise, and set it back to false (or retire the old version) once every VM has booted with the new token. docs/security.md, Rotating."
  type        = bool
  default     = false
}
