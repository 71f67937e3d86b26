variable "name" {
  description = "Name prefix for every resource (launch template, Auto Scaling group, IAM role)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,30}[a-z0-9]$", var.name))
    error_message = "name must be 2-32 lowercase letters, digits or '-', starting with a letter."
  }
}

variable "ami_id" {
  description = "AMI for the training instances (e.g. an AWS Deep Learning AMI). Needs python3 and systemd."
  type        = string

  validation {
    condition     = can(regex("^ami-[0-9a-f]{8,17}$", var.ami_id))
    error_message = "ami_id must look like ami-0123456789abcdef0."
  }
}

variable "instance_types" {
  description = "Instance types the Spot allocation may choose from, most preferred first. Several similar types make Spot capacity far more available."
  type        = list(string)

  validation {
    condition     = length(var.instance_types) >= 1 && length(var.instance_types) <= 20
    error_message = "instance_types must list 1 to 20 instance types."
  }
}

variable "subnet_ids" {
  description = "Subnets (ideally one per Availability Zone) the Auto Scaling group launches into."
  type        = list(string)

  validation {
    condition     = length(var.subnet_ids) >= 1 && alltrue([for s in var.subnet_ids : can(regex("^subnet-[0-9a-f]+$", s))])
    error_message = "subnet_ids must list at least one subnet id (subnet-...)."
  }
}

variable "security_group_ids" {
  description = "Security groups for the instances. spotguard itself needs only outbound HTTPS (S3) and the link-local metadata service."
  type        = list(string)
  default     = []
}

variable "key_name" {
  description = "EC2 key pair for SSH; null for none (use SSM Session Manager via additional_policy_arns instead)."
  type        = string
  default     = null
}

variable "min_size" {
  description = "Minimum number of instances in the Auto Scaling group."
  type        = number
  default     = 0

  validation {
    condition     = var.min_size >= 0
    error_message = "min_size must be >= 0."
  }
}

variable "max_size" {
  description = "Maximum number of instances. Keep one above desired_capacity so capacity rebalancing can launch a replacement before terminating."
  type        = number
  default     = 2

  validation {
    condition     = var.max_size >= 1
    error_message = "max_size must be >= 1."
  }
}

variable "desired_capacity" {
  description = "Number of training instances to keep running."
  type        = number
  default     = 1

  validation {
    condition     = var.desired_capacity >= 0
    error_message = "desired_capacity must be >= 0."
  }
}

variable "root_volume_size" {
  description = "Root EBS volume size in GiB (encrypted, gp3)."
  type        = number
  default     = 200

  validation {
    condition     = var.root_volume_size >= 8 && var.root_volume_size <= 16384
    error_message = "root_volume_size must be between 8 and 16384 GiB."
  }
}

variable "root_device_name" {
  description = "Root device name of the AMI: /dev/sda1 for Ubuntu-based AMIs, /dev/xvda for Amazon Linux."
  type        = string
  default     = "/dev/sda1"

  validation {
    condition     = can(regex("^/dev/(sda1|xvda|nvme0n1)$", var.root_device_name))
    error_message = "root_device_name must be /dev/sda1, /dev/xvda or /dev/nvme0n1."
  }
}

variable "ebs_kms_key_arn" {
  description = "KMS key for the root volume; null uses the account's default EBS key (the volume is encrypted either way)."
  type        = string
  default     = null
}

variable "create_bucket" {
  description = "Create the checkpoint bucket (versioned, encrypted, private). false: use an existing bucket named bucket_name."
  type        = bool
  default     = true
}

variable "bucket_name" {
  description = "S3 bucket for checkpoints (created when create_bucket is true)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be a valid S3 bucket name (3-63 lowercase letters, digits, '.', '-')."
  }
}

variable "checkpoint_prefix" {
  description = "Key prefix for this run's checkpoints. The instance role may touch nothing outside it."
  type        = string
  default     = "spotguard"

  validation {
    condition     = can(regex("^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*$", var.checkpoint_prefix))
    error_message = "checkpoint_prefix must be non-empty, without leading or trailing '/', and use S3-safe characters."
  }
}

variable "bucket_kms_key_arn" {
  description = "KMS key for bucket encryption (SSE-KMS); null uses the AWS managed aws/s3 key. The instance role is granted use of a key given here."
  type        = string
  default     = null
}

variable "noncurrent_version_expiration_days" {
  description = "Days a deleted or overwritten checkpoint object is kept as a noncurrent version (versioning guards against accidental deletes)."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be >= 1."
  }
}

variable "spotguard_package" {
  description = "pip requirement installed on the instances, pinned."
  type        = string
  default     = "spotguard[aws]==0.1.0"

  validation {
    condition     = can(regex("^[A-Za-z0-9_.\\[\\],<>=!~ +:/@-]+$", var.spotguard_package))
    error_message = "spotguard_package must be a pip requirement without quotes or shell metacharacters."
  }
}

variable "checkpoint_dir" {
  description = "Local checkpoint root shared by spotguard and the trainer. Put it under local_nvme_mount to use instance store NVMe."
  type        = string
  default     = "/var/lib/spotguard/checkpoints"

  validation {
    condition     = can(regex("^/[A-Za-z0-9._/-]+$", var.checkpoint_dir))
    error_message = "checkpoint_dir must be an absolute path of letters, digits, '.', '_', '-' and '/'."
  }
}

variable "local_nvme_mount" {
  description = "Where to mount the first instance store NVMe disk (formatted ext4 at boot); empty to not mount one. Instance store dies with the instance; spotguard uploads before it does."
  type        = string
  default     = ""

  validation {
    condition     = var.local_nvme_mount == "" || can(regex("^/[A-Za-z0-9._/-]+$", var.local_nvme_mount))
    error_message = "local_nvme_mount must be empty or an absolute path."
  }
}

variable "trainer_user" {
  description = "Unix user the trainer runs as (created if missing). It runs with group spotguard to reach the daemon's socket."
  type        = string
  default     = "ubuntu"

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
  description = "Extra lines appended to /etc/spotguard/spotguard.toml, e.g. \"on_rebalance = \\\"stop\\\"\". See systemd/spotguard.toml.example."
  type        = string
  default     = ""
}

variable "termination_grace_seconds" {
  description = "Heartbeat timeout of the termination lifecycle hook: how long an instance the group itself terminates (capacity rebalance, scale-in) stays in Terminating:Wait so spotguard can upload. Spot interruptions still end after AWS's 2 minutes."
  type        = number
  default     = 180

  validation {
    condition     = var.termination_grace_seconds >= 30 && var.termination_grace_seconds <= 7200
    error_message = "termination_grace_seconds must be between 30 and 7200."
  }
}

variable "additional_policy_arns" {
  description = "Extra managed policies for the instance role, e.g. AmazonSSMManagedInstanceCore for Session Manager or ECR read access."
  type        = list(string)
  default     = []
}

variable "tags" {
  description = "Tags for every resource, and propagated to the instances and their volumes."
  type        = map(string)
  default     = {}
}

# --- the peer tier ----------------------------------------------------------------------

variable "enable_peers" {
  description = "Run spotguard's peer tier: each instance's daemon listens on peer_port, registers under the bucket's .spotguard-peers/ (peers = \"bucket\") and, when an urgent checkpoint cannot reach the bucket before the deadline, hands it to another instance of the group, which commits it there. Needs peer_token_secret_arn."
  type        = bool
  default     = false
}

variable "peer_port" {
  description = "TCP port the daemons take each other's checkpoints on; open only between the group's own instances (a security group of its own)."
  type        = number
  default     = 7140

  validation {
    condition     = var.peer_port >= 1024 && var.peer_port <= 65535
    error_message = "peer_port must be between 1024 and 65535."
  }
}

variable "peer_token_secret_arn" {
  description = "ARN of the Secrets Manager secret holding the job's peer token (a SecretString of at least 16 bytes, e.g. openssl rand -hex 32). Created outside this module, so the token never sits in Terraform state; the instance role may read this secret and no other."
  type        = string
  default     = null

  validation {
    condition     = var.peer_token_secret_arn == null || can(regex("^arn:[a-z-]+:secretsmanager:[a-z0-9-]+:[0-9]{12}:secret:.+$", var.peer_token_secret_arn))
    error_message = "peer_token_secret_arn must be a Secrets Manager secret ARN (arn:aws:secretsmanager:REGION:ACCOUNT:secret:NAME-xxxxxx)."
  }
}

variable "peer_token_kms_key_arn" {
  description = "Customer-managed KMS key the peer token secret is encrypted with, if any (the role gets kms:Decrypt on it); null for the account's aws/secretsmanager key."
  type        = string
  default     = null
}

variable "peer_token_accept_previous" {
  description = "While the job's peer token is rotated: each daemon also accepts the Secrets Manager secret's AWSPREVIOUS version (read at boot), so VMs started before and after the rotation stay peers. Leave false after a rotation forced by a compromise, and set it back to false (or retire the old version) once every VM has booted with the new token. docs/security.md, Rotating."
  type        = bool
  default     = false
}
