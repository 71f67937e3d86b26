data "aws_partition" "current" {}

data "aws_region" "current" {}

locals {
  lifecycle_hook = "spotguard-drain"
  bucket_name    = var.create_bucket ? aws_s3_bucket.checkpoints[0].id : var.bucket_name
  bucket_arn     = "arn:${data.aws_partition.current.partition}:s3:::${var.bucket_name}"
  bucket_url     = "s3://${local.bucket_name}/${var.checkpoint_prefix}"

  # Everything the bootstrap script needs. tests/deploy renders the template with these keys,
  # so a placeholder without a key here (or the reverse) fails the tests, not a boot.
  cloud_init_vars = {
    provider          = "aws"
    spotguard_package = var.spotguard_package
    bucket_url        = local.bucket_url
    checkpoint_dir    = var.checkpoint_dir
    local_nvme_mount  = var.local_nvme_mount
    # Instance store NVMe disks, as udev names them on Nitro instances.
    nvme_device_glob = "/dev/disk/by-id/nvme-Amazon_EC2_NVMe_Instance_Storage_*"
    trainer_user     = var.trainer_user
    trainer_command  = var.trainer_command
    trainer_env      = join("\n", [for k, v in var.trainer_environment : "${k}=${v}"])
    # The peer tier (empty: off): the port, the secret the bootstrap reads the token from, and
    # whether it reads the secret's previous version too (a rotation: docs/security.md).
    peer_port     = var.enable_peers ? tostring(var.peer_port) : ""
    peer_secret   = var.enable_peers ? coalesce(var.peer_token_secret_arn, "-") : ""
    peer_previous = var.enable_peers && var.peer_token_accept_previous ? "previous" : ""
    # spotguard completes the termination lifecycle hook below once the checkpoint is in the bucket.
    extra_config = join("\n", compact(["asg_lifecycle_hook = \"${local.lifecycle_hook}\"", var.extra_config]))
    # The units are the repository's own files, so the fleet runs exactly what was verified.
    spotguard_unit = chomp(file("${path.module}/../../../systemd/spotguard.service"))
    trainer_unit   = chomp(file("${path.module}/../../../systemd/example-trainer.service"))
  }
}

# --- checkpoint bucket ------------------------------------------------------------------

resource "aws_s3_bucket" "checkpoints" {
  count = var.create_bucket ? 1 : 0
  #checkov:skip=CKV_AWS_18:Access logs for a checkpoint bucket need a second log bucket; CloudTrail data events are the better audit trail here and are account-level.
  #checkov:skip=CKV_AWS_144:Cross-region replication doubles storage for checkpoints that are superseded within hours; a lost region loses the training fleet too.
  #checkov:skip=CKV2_AWS_62:Nothing consumes events for checkpoint objects; the manifest written last is the commit signal.

  bucket = var.bucket_name
  tags   = var.tags
}

resource "aws_s3_bucket_ownership_controls" "checkpoints" {
  count  = var.create_bucket ? 1 : 0
  bucket = aws_s3_bucket.checkpoints[0].id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "checkpoints" {
  count  = var.create_bucket ? 1 : 0
  bucket = aws_s3_bucket.checkpoints[0].id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "checkpoints" {
  count  = var.create_bucket ? 1 : 0
  bucket = aws_s3_bucket.checkpoints[0].id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "checkpoints" {
  count  = var.create_bucket ? 1 : 0
  bucket = aws_s3_bucket.checkpoints[0].id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = var.bucket_kms_key_arn
    }
    # One KMS data key per bucket instead of per object: multipart checkpoints make many requests.
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "checkpoints" {
  count  = var.create_bucket ? 1 : 0
  bucket = aws_s3_bucket.checkpoints[0].id

  # A VM that dies mid-upload leaves parts behind; they are billed until aborted.
  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }
  }

  # spotguard's retention deletes old checkpoints; versioning keeps them for a while in case
  # that was a mistake, then they go.
  rule {
    id     = "expire-noncurrent-versions"
    status = "Enabled"

    filter {}

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_expiration_days
    }

    expiration {
      expired_object_delete_marker = true
    }
  }

  depends_on = [aws_s3_bucket_versioning.checkpoints]
}

data "aws_iam_policy_document" "bucket" {
  count = var.create_bucket ? 1 : 0

  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.checkpoints[0].arn,
      "${aws_s3_bucket.checkpoints[0].arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "checkpoints" {
  count  = var.create_bucket ? 1 : 0
  bucket = aws_s3_bucket.checkpoints[0].id
  policy = data.aws_iam_policy_document.bucket[0].json

  depends_on = [aws_s3_bucket_public_access_block.checkpoints]
}

# --- instance role: this run's prefix and nothing else -----------------------------------

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "checkpoints" {
  statement {
    sid       = "ListOwnPrefix"
    actions   = ["s3:ListBucket"]
    resources = [local.bucket_arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.checkpoint_prefix, "${var.checkpoint_prefix}/*"]
    }
  }

  # s3:prefix is no condition key of ListBucketMultipartUploads: under the condition above, the
  # daemon's start-up sweep of unfinished uploads (under its prefix; it always sends one) is refused.
  statement {
    sid       = "ListUnfinishedUploads"
    actions   = ["s3:ListBucketMultipartUploads"]
    resources = [local.bucket_arn]
  }

  statement {
    sid = "ReadWriteOwnPrefix"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = ["${local.bucket_arn}/${var.checkpoint_prefix}/*"]
  }

  dynamic "statement" {
    for_each = var.bucket_kms_key_arn == null ? [] : [var.bucket_kms_key_arn]

    content {
      sid       = "UseBucketKey"
      actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_role" "this" {
  name_prefix        = "${var.name}-"
  description        = "spotguard fleet ${var.name}: checkpoints under s3://${var.bucket_name}/${var.checkpoint_prefix}"
  assume_role_policy = data.aws_iam_policy_document.assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy" "checkpoints" {
  name   = "spotguard-checkpoints"
  role   = aws_iam_role.this.id
  policy = data.aws_iam_policy_document.checkpoints.json
}

# CompleteLifecycleAction once the checkpoint is committed; a policy of its own, since it names the group.
data "aws_iam_policy_document" "lifecycle" {
  statement {
    sid       = "CompleteOwnLifecycleHook"
    actions   = ["autoscaling:CompleteLifecycleAction"]
    resources = [aws_autoscaling_group.this.arn]
  }

  statement {
    sid       = "FindOwnGroup"
    actions   = ["autoscaling:DescribeAutoScalingInstances"]
    resources = ["*"] # a Describe action takes no resource-level permissions
  }
}

resource "aws_iam_role_policy" "lifecycle" {
  name   = "spotguard-lifecycle"
  role   = aws_iam_role.this.id
  policy = data.aws_iam_policy_document.lifecycle.json
}

# The peer tier's token: this one secret, read once at boot by the bootstrap script.
data "aws_iam_policy_document" "peer_token" {
  count = var.enable_peers ? 1 : 0

  statement {
    sid       = "ReadPeerToken"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [var.peer_token_secret_arn]
  }

  dynamic "statement" {
    for_each = var.peer_token_kms_key_arn == null ? [] : [var.peer_token_kms_key_arn]

    content {
      sid       = "DecryptPeerToken"
      actions   = ["kms:Decrypt"]
      resources = [statement.value]

      condition {
        test     = "StringEquals"
        variable = "kms:ViaService"
        values   = ["secretsmanager.${data.aws_region.current.name}.amazonaws.com"]
      }
    }
  }
}

resource "aws_iam_role_policy" "peer_token" {
  count  = var.enable_peers ? 1 : 0
  name   = "spotguard-peer-token"
  role   = aws_iam_role.this.id
  policy = data.aws_iam_policy_document.peer_token[0].json
}

resource "aws_iam_role_policy_attachment" "additional" {
  for_each = toset(var.additional_policy_arns)

  role       = aws_iam_role.this.name
  policy_arn = each.value
}

resource "aws_iam_instance_profile" "this" {
  name_prefix = "${var.name}-"
  role        = aws_iam_role.this.name
  tags        = var.tags
}

# --- the peer tier: the peer port between the group's own instances, nothing else ---------

data "aws_subnet" "first" {
  count = var.enable_peers ? 1 : 0
  id    = var.subnet_ids[0]
}

resource "aws_security_group" "peers" {
  count       = var.enable_peers ? 1 : 0
  name_prefix = "${var.name}-peers-"
  description = "spotguard peer tier of ${var.name}: the peer port, between the fleet's own instances only"
  vpc_id      = data.aws_subnet.first[0].vpc_id
  tags        = merge(var.tags, { Name = "${var.name}-peers" })

  lifecycle {
    create_before_destroy = true
  }
}

# Members of the group reach each other's peer port; nothing else does (the rules name the group
# itself, never an address range).
resource "aws_vpc_security_group_ingress_rule" "peers" {
  count                        = var.enable_peers ? 1 : 0
  security_group_id            = aws_security_group.peers[0].id
  referenced_security_group_id = aws_security_group.peers[0].id
  ip_protocol                  = "tcp"
  from_port                    = var.peer_port
  to_port                      = var.peer_port
  description                  = "spotguard peer port, from the fleet's own instances"
}

resource "aws_vpc_security_group_egress_rule" "peers" {
  count                        = var.enable_peers ? 1 : 0
  security_group_id            = aws_security_group.peers[0].id
  referenced_security_group_id = aws_security_group.peers[0].id
  ip_protocol                  = "tcp"
  from_port                    = var.peer_port
  to_port                      = var.peer_port
  description                  = "spotguard peer port, to the fleet's own instances"
}

# --- launch template and Spot Auto Scaling group ----------------------------------------

resource "aws_launch_template" "this" {
  #checkov:skip=CKV_AWS_341:Hop limit 2 is deliberate: spotguard and the trainer may run in containers (one more hop) and need IMDSv2 tokens; tokens stay required.
  name_prefix            = "${var.name}-"
  description            = "spotguard training fleet ${var.name}"
  image_id               = var.ami_id
  key_name               = var.key_name
  vpc_security_group_ids = concat(var.security_group_ids, aws_security_group.peers[*].id)
  ebs_optimized          = true
  update_default_version = true
  user_data              = base64encode(templatefile("${path.module}/templates/cloud-init.sh.tftpl", local.cloud_init_vars))

  iam_instance_profile {
    arn = aws_iam_instance_profile.this.arn
  }

  # IMDSv2 only. Hop limit 2 lets a container on the instance (one more network hop) get a
  # token too, so spotguard and the AWS SDK work from Docker with bridge networking.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 2
    instance_metadata_tags      = "disabled"
  }

  block_device_mappings {
    device_name = var.root_device_name

    ebs {
      volume_size           = var.root_volume_size
      volume_type           = "gp3"
      encrypted             = true
      kms_key_id            = var.ebs_kms_key_arn
      delete_on_termination = true
    }
  }

  monitoring {
    enabled = true
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = var.name })
  }

  tag_specifications {
    resource_type = "volume"
    tags          = merge(var.tags, { Name = var.name })
  }

  tags = var.tags

  lifecycle {
    precondition {
      condition     = !var.enable_peers || var.peer_token_secret_arn != null
      error_message = "enable_peers needs peer_token_secret_arn: the Secrets Manager secret holding the job's peer token."
    }
  }
}

resource "aws_autoscaling_group" "this" {
  name_prefix         = "${var.name}-"
  min_size            = var.min_size
  max_size            = var.max_size
  desired_capacity    = var.desired_capacity
  vpc_zone_identifier = var.subnet_ids
  health_check_type   = "EC2"

  # Launch a replacement when AWS signals elevated interruption risk (rebalance
  # recommendation), then terminate the old instance through the lifecycle hook below.
  # spotguard sees the rebalance notice first and saves early.
  capacity_rebalance = true

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = 0
      on_demand_percentage_above_base_capacity = 0
      spot_allocation_strategy                 = "price-capacity-optimized"
    }

    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.this.id
        version            = aws_launch_template.this.latest_version
      }

      dynamic "override" {
        for_each = var.instance_types

        content {
          instance_type = override.value
        }
      }
    }
  }

  # Terminations the group starts itself wait here while spotguard (which sees the
  # target-lifecycle-state "Terminated" in IMDS) checkpoints and uploads; spotguard then completes
  # the action (CONTINUE), or the instance goes when the timeout is up.
  initial_lifecycle_hook {
    name                 = local.lifecycle_hook
    lifecycle_transition = "autoscaling:EC2_INSTANCE_TERMINATING"
    heartbeat_timeout    = var.termination_grace_seconds
    default_result       = "CONTINUE"
  }

  instance_refresh {
    strategy = "Rolling"

    preferences {
      min_healthy_percentage = 0
    }
  }

  dynamic "tag" {
    for_each = merge(var.tags, { Name = var.name })

    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
}
