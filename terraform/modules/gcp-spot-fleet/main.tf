locals {
  bucket_name = var.create_bucket ? google_storage_bucket.checkpoints[0].name : var.bucket_name
  bucket_url  = "gs://${local.bucket_name}/${var.checkpoint_prefix}"
  # The peer tier's firewall rule opens the peer port between VMs with this tag, and only them.
  peer_tag = "${var.name}-spotguard-peer"

  # Everything the startup script needs. tests/deploy renders the template with these keys,
  # so a placeholder without a key here (or the reverse) fails the tests, not a boot.
  startup_script_vars = {
    provider          = "gcp"
    spotguard_package = var.spotguard_package
    bucket_url        = local.bucket_url
    checkpoint_dir    = var.checkpoint_dir
    local_nvme_mount  = var.local_ssd_count > 0 ? var.local_nvme_mount : ""
    # Local SSDs with the NVMe interface, as the guest environment's udev rules name them.
    nvme_device_glob = "/dev/disk/by-id/google-local-nvme-ssd-*"
    trainer_user     = var.trainer_user
    trainer_command  = var.trainer_command
    trainer_env      = join("\n", [for k, v in var.trainer_environment : "${k}=${v}"])
    extra_config     = var.extra_config
    # The peer tier (empty: off): the port, the secret the startup script reads the token from, and
    # whether it reads the secret's previous version too (a rotation: docs/security.md).
    peer_port     = var.enable_peers ? tostring(var.peer_port) : ""
    peer_secret   = var.enable_peers ? coalesce(var.peer_token_secret, "-") : ""
    peer_previous = var.enable_peers && var.peer_token_accept_previous ? "previous" : ""
    # The units are the repository's own files, so the fleet runs exactly what was verified.
    spotguard_unit = chomp(file("${path.module}/../../../systemd/spotguard.service"))
    trainer_unit   = chomp(file("${path.module}/../../../systemd/example-trainer.service"))
  }
}

# --- service account: this run's prefix and nothing else --------------------------------

resource "google_service_account" "this" {
  project      = var.project_id
  account_id   = var.name
  display_name = "spotguard fleet ${var.name}"
  description  = "Training VMs: checkpoints under gs://${var.bucket_name}/${var.checkpoint_prefix}"
}

# objectUser (read, write, delete objects and multipart uploads) on this bucket only, and,
# through the condition, only on objects under the prefix. Bucket-level permissions such as
# storage.objects.list are checked against the bucket resource, which the first clause lets
# through: listing shows names across the bucket, reading and writing stay inside the prefix.
resource "google_storage_bucket_iam_member" "checkpoints" {
  bucket = local.bucket_name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.this.email}"

  condition {
    title       = "spotguard-prefix-${var.name}"
    description = "Objects under ${var.checkpoint_prefix}/ only"
    expression  = "resource.type == \"storage.googleapis.com/Bucket\" || resource.name.startsWith(\"projects/_/buckets/${var.bucket_name}/objects/${var.checkpoint_prefix}/\")"
  }
}

# --- the peer tier: the token's secret, and the peer port between the fleet's own VMs -------

resource "google_secret_manager_secret_iam_member" "peer_token" {
  count     = var.enable_peers ? 1 : 0
  project   = split("/", var.peer_token_secret)[1]
  secret_id = var.peer_token_secret
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.this.email}"
}

# The network the subnetwork belongs to (a shared VPC's host project included): the rule lives there.
data "google_compute_subnetwork" "this" {
  count     = var.enable_peers ? 1 : 0
  self_link = strcontains(var.subnetwork, "/") ? var.subnetwork : null
  name      = basename(var.subnetwork)
  project   = var.project_id
  region    = var.region
}

resource "google_compute_firewall" "peers" {
  count       = var.enable_peers ? 1 : 0
  project     = data.google_compute_subnetwork.this[0].project
  name        = "${var.name}-spotguard-peers"
  description = "spotguard peer tier of ${var.name}: the peer port, between the fleet's own VMs only"
  network     = data.google_compute_subnetwork.this[0].network
  direction   = "INGRESS"
  source_tags = [local.peer_tag]
  target_tags = [local.peer_tag]

  allow {
    protocol = "tcp"
    ports    = [tostring(var.peer_port)]
  }
}

# --- checkpoint bucket ------------------------------------------------------------------

resource "google_storage_bucket" "checkpoints" {
  count = var.create_bucket ? 1 : 0
  #checkov:skip=CKV_GCP_62:Access logs need a second log bucket; Cloud Audit Logs (data access) are the better trail for checkpoint objects.

  project                     = var.project_id
  name                        = var.bucket_name
  location                    = var.bucket_location
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  force_destroy               = false
  labels                      = var.labels

  versioning {
    enabled = true
  }

  dynamic "encryption" {
    for_each = var.bucket_kms_key_name == null ? [] : [var.bucket_kms_key_name]

    content {
      default_kms_key_name = encryption.value
    }
  }

  # A VM preempted mid-upload leaves XML-API multipart parts behind; they are billed until aborted.
  lifecycle_rule {
    condition {
      age = 1
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  # spotguard's retention deletes old checkpoints; versioning keeps them a while, then they go.
  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.noncurrent_version_expiration_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }
}

# --- instance template and managed instance group ---------------------------------------

resource "google_compute_instance_template" "this" {
  project      = var.project_id
  name_prefix  = "${var.name}-"
  description  = "spotguard Spot training fleet ${var.name}"
  machine_type = var.machine_type
  region       = var.region
  tags         = concat(var.network_tags, var.enable_peers ? [local.peer_tag] : [])
  labels       = var.labels

  # Spot: preemptible with ~30 s notice. spotguard long-polls instance/preempted.
  scheduling {
    provisioning_model          = "SPOT"
    preemptible                 = true
    automatic_restart           = false
    on_host_maintenance         = "TERMINATE"
    instance_termination_action = var.termination_action
  }

  disk {
    boot         = true
    auto_delete  = true
    source_image = var.source_image
    disk_size_gb = var.boot_disk_size_gb
    disk_type    = "pd-balanced"
    labels       = var.labels

    dynamic "disk_encryption_key" {
      for_each = var.disk_kms_key_self_link == null ? [] : [var.disk_kms_key_self_link]

      content {
        kms_key_self_link = disk_encryption_key.value
      }
    }
  }

  dynamic "disk" {
    for_each = range(var.local_ssd_count)

    content {
      type         = "SCRATCH"
      disk_type    = "local-ssd"
      interface    = "NVME"
      disk_size_gb = 375
    }
  }

  dynamic "guest_accelerator" {
    for_each = var.gpu_type == null ? [] : [var.gpu_type]

    content {
      type  = guest_accelerator.value
      count = var.gpu_count
    }
  }

  # No access_config: no external IP.
  network_interface {
    subnetwork = var.subnetwork
  }

  shielded_instance_config {
    enable_secure_boot          = var.enable_secure_boot
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  metadata = {
    startup-script         = templatefile("${path.module}/templates/startup-script.sh.tftpl", local.startup_script_vars)
    block-project-ssh-keys = "true"
    enable-oslogin         = "TRUE"
    serial-port-enable     = "false"
  }

  # The scope is the broadest; what the VM may actually do is the service account's IAM above.
  service_account {
    email  = google_service_account.this.email
    scopes = ["cloud-platform"]
  }

  lifecycle {
    create_before_destroy = true

    precondition {
      condition     = !var.enable_peers || var.peer_token_secret != null
      error_message = "enable_peers needs peer_token_secret: the Secret Manager secret (projects/PROJECT/secrets/NAME) holding the job's peer token."
    }
  }
}

resource "google_compute_region_instance_group_manager" "this" {
  project                   = var.project_id
  name                      = var.name
  base_instance_name        = var.name
  region                    = var.region
  distribution_policy_zones = var.zones
  target_size               = var.target_size

  version {
    instance_template = google_compute_instance_template.this.self_link
  }

  # A preempted VM is recreated by the group; its replacement restores the newest complete
  # checkpoint in the startup script. Template changes roll out only when VMs are recreated
  # anyway (OPPORTUNISTIC), never by killing a training VM mid-step.
  update_policy {
    type                         = "OPPORTUNISTIC"
    minimal_action               = "REPLACE"
    instance_redistribution_type = "NONE"
    max_surge_fixed              = 0
    max_unavailable_fixed        = length(var.zones)
  }
}
